"""KServe's Python SDK (kserve 0.21) calling a live server, run in a process of its own.

kserve's generated messages and tritonclient.grpc's both register the package `inference` in
protobuf's default descriptor pool under different file names, and the second import fails
("duplicate symbol 'inference.ServerLiveRequest'"): the e2e tests reach kserve through a
spawned worker process (tests/e2e/test_v2_kserve.py) that imports only this module. Each call
returns the outputs as numpy arrays, or the error as plain values (status or code, and text).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import numpy as np

from tests.support.v2_cases import Case


@dataclass(frozen=True)
class Refused:
    """An error answer: the HTTP status (REST) or the gRPC code's name, and its text."""

    status: int | str
    text: str


@dataclass(frozen=True)
class Answer:
    model_name: str
    id: str | None
    outputs: dict[str, np.ndarray]


def _request(
    case: Case,
    *,
    binary: bool,
    outputs: tuple[str, ...],
    binary_outputs: bool,
    model_name: str,
    request_id: str | None,
    as_lists: bool,
) -> Any:
    """The case as KServe's InferRequest, as its users build one."""
    import kserve
    from kserve.protocol.infer_type import RequestedOutput

    inputs = []
    for name, array, datatype in case.inputs():
        if as_lists:  # data as a list: typed `contents` over gRPC
            tensor = kserve.InferInput(
                name=name, shape=list(array.shape), datatype=datatype, data=array.ravel().tolist()
            )
        else:
            tensor = kserve.InferInput(name=name, shape=list(array.shape), datatype=datatype)
            tensor.set_data_from_numpy(array, binary_data=binary)
        inputs.append(tensor)
    requested = [
        RequestedOutput(name, parameters={"binary_data": True} if binary_outputs else None)
        for name in outputs
    ]
    return kserve.InferRequest(
        model_name=model_name,
        infer_inputs=inputs,
        request_outputs=requested or None,
        parameters=case.request_parameters() or None,
        request_id=request_id,
    )


def _answer(response: Any) -> Answer:
    outputs = {output.name: output.as_numpy() for output in response.outputs}
    return Answer(model_name=response.model_name, id=response.id, outputs=outputs)


def rest_infer(
    url: str,
    case: Case,
    *,
    key: str,
    binary: bool = False,
    outputs: tuple[str, ...] = (),
    binary_outputs: bool = False,
    model_name: str = "attention",
    request_id: str | None = None,
) -> Answer | Refused:
    """InferenceRESTClient.infer to /v2/models/attention/infer, the body naming `model_name`."""
    import httpx
    import kserve

    request = _request(
        case, binary=binary, outputs=outputs, binary_outputs=binary_outputs,
        model_name=model_name, request_id=request_id, as_lists=False,
    )  # fmt: skip

    async def call() -> Any:
        client = kserve.InferenceRESTClient(kserve.RESTConfig(protocol="v2", timeout=60))
        try:
            # A dict of its own each call: for binary data the client writes its header-length
            # header into the caller's dict (kserve 0.21, InferenceRESTClient.infer).
            headers = {"Authorization": f"Bearer {key}"}
            return await client.infer(url, request, model_name="attention", headers=headers)
        finally:
            await client.close()

    try:
        return _answer(asyncio.run(call()))
    except httpx.HTTPStatusError as exc:
        return Refused(exc.response.status_code, exc.response.text)


def grpc_infer(
    target: str,
    case: Case,
    *,
    key: str,
    outputs: tuple[str, ...] = (),
    model_name: str = "attention",
    as_lists: bool = False,
) -> Answer | Refused:
    """InferenceGRPCClient.infer on the gRPC door."""
    import grpc
    import kserve

    request = _request(
        case, binary=True, outputs=outputs, binary_outputs=False, model_name=model_name,
        request_id=None, as_lists=as_lists,
    )  # fmt: skip

    async def call() -> Any:
        client = kserve.InferenceGRPCClient(target, timeout=60)
        try:
            return await client.infer(request, headers=(("authorization", f"Bearer {key}"),))
        finally:
            await client.close()

    try:
        return _answer(asyncio.run(call()))
    except grpc.aio.AioRpcError as exc:
        return Refused(exc.code().name, exc.details() or "")
