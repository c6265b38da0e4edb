"""The application's state, typed, and the dependencies routes declare to read it.

create_app() stores one AppState (service.serving.state) on app.state. Routes take
`state: StateDep` (or a narrower alias) instead of reading app.state's untyped attributes.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, FastAPI, Request

from service.metrics import Metrics
from service.serving.state import AppState
from service.settings import Settings


def state_of(app: FastAPI) -> AppState:
    """The AppState create_app() stored on the application."""
    state = app.state.sdpa
    if not isinstance(state, AppState):  # an app not built by create_app(): our bug
        raise TypeError("app.state.sdpa is not an AppState: build the app with create_app()")
    return state


async def _state_dep(request: Request) -> AppState:
    # async: FastAPI runs a sync dependency on a worker thread, a cost on every request.
    return state_of(request.app)


StateDep = Annotated[AppState, Depends(_state_dep)]


async def _settings_dep(state: StateDep) -> Settings:
    return state.settings


async def _metrics_dep(state: StateDep) -> Metrics:
    return state.metrics


SettingsDep = Annotated[Settings, Depends(_settings_dep)]
MetricsDep = Annotated[Metrics, Depends(_metrics_dep)]
