"""The HTTP/1.1 protocol layer, below ASGI: limits on what uvicorn's httptools protocol leaves
unbounded below the application, where ASGI middleware cannot see (it runs only once a
request's headers are complete). The service runs uvicorn with GuardedHttpToolsProtocol
(`uvicorn.Config(http=...)`, built by guarded_protocol() from the settings).

One module per job: heads (head limits), framing (body framing), pipelining, timers (read,
head deadline, body rate, send), cap (the connection cap), linger, shutdown, delivery; their
refusals in errors; connection binds them into the protocol class and holds its state.

What uvicorn 0.54 with httptools 0.9 does on its own, checked in their code: it feeds every
byte it reads to the parser at once; the parser builds a header value with `bytes +=` across
reads (quadratic: a 64 MB value took 3.1 s of event-loop time) and uvicorn keeps every header
line, without limit; a read of pipelined requests is parsed whole, each request becoming a task's
worth of state at once, and reading resumes after every answer (GET /healthz pipelined and never
read grew a server to 4.96 GB); it arms no timer on a fresh connection nor while headers or a
body trickle in; its `limit_concurrency` answers 503 only once a request arrives on a
connection it already accepted. So this protocol keeps the bytes it reads and decides itself
what the parser may have:

- header bytes (SDPA_MAX_HEADER_BYTES, default 32 KiB): the request line and all header lines
  of one request, blank lines before it and the empty line that ends it included. The bytes of
  a request's head are held until a whole line is in, and the parser is fed whole lines (each
  header value reaches it in one piece: nothing is concatenated); a head that cannot end within
  the budget gets a 431 problem+json and the connection closes, before the parser saw more than
  the budget.
- header lines (SDPA_MAX_HEADERS, default 100): counted before they reach the parser; past
  the bound, 431 and the connection closes.
- a chunked body's trailer section has the same two bounds. Past one, nothing more of the
  connection is parsed; the app already holds the request, so its next receive() raises a 431
  (TrailersTooLarge), which the app answers as it answers its own refusals (its access log
  says 431), and the connection closes after that answer.
- a chunked body's framing: each chunk costs Python time here (reading where the body ends),
  whatever its size, and llhttp takes a size line of any length. A size line (hex digits,
  leading zeros, extensions, CRLF) past MAX_CHUNK_SIZE_LINE (4 KiB), and a body whose chunks
  past the first FREE_CHUNKS (1,024) bring under MIN_CHUNK_AVERAGE (64 bytes) of data each on
  average, get a 400 the same way (ChunksRefused, from the app's receive()). Before, a 240 KB
  read of 1-byte chunks held the event loop 131 ms (plain uvicorn: 23 ms), now 1 ms and
  refused; and 32 KiB/s of an endless extension held a connection and the app's request for
  ever. A body llhttp cannot frame (a size that is not hex, data without its CRLF, a
  Transfer-Encoding other than chunked) gets a 400 the same way (BadBodyFraming), uncounted.
- header deadline (SDPA_READ_TIMEOUT_S, default 15 s): a request's headers must be complete
  within it of their first byte, however steadily they trickle; else a 408 problem+json and the
  connection closes.
- idle read timeout (the same setting): while the server waits for a client's bytes (a fresh
  connection's first request, a body), every byte restarts a timer. When it fires on a fresh
  connection, the client gets a 408; mid-body (the app has the request) the connection closes
  and the app sees the disconnect (a 499 in the access log). While the app computes or answers,
  or while the server itself stopped reading, no read timer runs.
- minimum body rate (SDPA_MIN_BODY_RATE, default 32 KiB/s; 0 = none), as Apache
  mod_reqtimeout's body=...,MinRate=...: a body must arrive within SDPA_READ_TIMEOUT_S of the
  app's first read of it, extended by one second for every SDPA_MIN_BODY_RATE bytes it
  brought (of a chunked body, its chunks' data, not their framing); the time the server itself
  does not read (the app has not read what it was given, the request waits behind another)
  does not count. Past it the connection closes, as the idle timer does mid-body. Without it,
  a byte every few seconds held a connection whose request the app holds for ever, and the
  cap never closes those: 2,048 of them, about 205 B/s in all, locked everyone out; now that
  takes SDPA_MIN_BODY_RATE x SDPA_MAX_CONNECTIONS (64 MiB/s).
- an answer given before its request's body was read (an early 413, 401 or 503): the rest of
  that body is never parsed, nor anything after it. The answer is written and the sending
  side closed, what the client still sends is read and dropped for linger_s (2 s) at most, and
  the connection closes (RFC 9112 section 9.6). uvicorn reads on, dropping the body as it comes,
  for as long as a client sends a byte now and then.
- Upgrade (h2c, websocket) and CONNECT requests: llhttp ends one at its head and never
  delivers its body. Without a body it is answered as a plain request (the service speaks
  HTTP/1.1 only) with Connection: close, and nothing after its head is parsed; with a body
  (Content-Length or Transfer-Encoding) it gets a 400 before the app sees it, and the
  connection closes: the app would have answered it without its body, and the body was parsed
  as the next request (request smuggling behind a proxy that forwards Upgrade).
- pipelining (SDPA_MAX_PIPELINED_REQUESTS, default 8): at most that many requests of one
  connection parsed and unanswered. The parser is fed one request's head at a time and a body
  only up to its end (Content-Length, or the chunked framing read here), so it never parses
  ahead; beyond the bound the server holds the bytes it read and stops reading the connection
  (backpressure: no queue, no 4xx), and feeds the next request as answers complete. Each such
  pause counts in sdpa_connection_reads_paused_total. A request's body is fed only while the
  app has read what it was given before (uvicorn's 64 KiB high-water mark), so the body of a
  request waiting behind another does not grow either. A pipelined request refused at its
  head (431, 408, an upgrade with a body, unparsable) while answers before it are pending is
  answered after them, in order (RFC 9112 section 9.3.2), and nothing more is read meanwhile.
  Any refusal on a connection that answered before lingers as an early answer does: the
  answers may still sit in the kernel's send queue, and a close with the client's bytes unread
  resets the connection and drops them. A head under way when an answer completes is bounded
  by its deadline, not uvicorn's keep-alive timer (which closed it mid-head).
- send timeout (SDPA_SEND_TIMEOUT_S, default 60 s): when the client stops reading and the write
  buffer passes its high-water mark, a timer starts; it stops when the client reads again. When
  it fires, the connection is aborted and the pending response freed.
- connection cap (SDPA_MAX_CONNECTIONS, default 2048): a connection beyond it closes the one
  doing no useful work to make room: the one whose request headers have been incomplete the
  longest (a connection that sent nothing yet counts from its start) gets a 408, else the one
  idle the longest between keep-alive requests gets a 503 with Retry-After. A connection whose
  request the app holds (its body being read, computed, answered) is never closed for it. Only
  when every connection is busy does the newcomer get a 503 with Retry-After, before any
  request is read. A slowloris client thus holds its connections only until others need them.
  A connection answered early and lingering goes first of all, without a word. The candidates
  of each kind are kept in arrival order as their state changes, so a newcomer at the cap
  costs the event loop the same whatever the cap (a scan of every connection took 4.4 ms per
  newcomer at 2,048 connections).
- shutdown: when uvicorn shuts down (after the drain), a connection with no request in the app
  is not closed at once, since its client may be sending a request right then, which would be
  lost unanswered: it gets `shutdown_idle_grace_s` (0.5 s) for a request's headers to complete,
  which is then answered (with `Connection: close`); otherwise it closes (a 503 if a request's
  headers were under way). A connection with a request in the app closes after that answer;
  requests pipelined behind it are not read.
- delivery: an answer handed to a client that reads slower than the server writes is not yet
  delivered. Each request's scope carries, as the ASGI extension DELIVERY_EXTENSION, an awaitable
  that tells whether its answer reached the client (the access log logs 499 when it did not:
  the client left, or the send timeout dropped it, while its answer was being sent).

Refusals count in sdpa_rejected_total by reason: header_too_large (431, trailers included),
header_timeout (408 at the header deadline), read_timeout (the idle timer), body_too_slow (the
minimum body rate), chunk_framing (400: a chunked body's framing), connections (the cap: a
connection closed to make room, or a newcomer refused).

Why this layer and not uvicorn's h11 protocol with its limit (h11_max_incomplete_event_size):
h11 bounds a head's bytes (a 400, no metric) and parses one request at a time, but counts no
header lines, has no header deadline, no read or send timeout and no cap, which would all have
to be added to it as they are here; and its pure-Python parsing served small requests about 7%
slower than this layer in the same run (bench/attack_protocol.py's figures, issue 23's note).

The uvicorn and httptools behaviour this relies on, private attributes included, is exercised
by tests/service/protocol/ (its contract tests); pyproject.toml pins the versions it was checked on.
"""

from service.protocol.connection import GuardedHttpToolsProtocol, guarded_protocol
from service.protocol.delivery import DELIVERY_EXTENSION, Delivery, unsent_bytes
from service.protocol.shutdown import last_activity

__all__ = [
    "DELIVERY_EXTENSION",
    "Delivery",
    "GuardedHttpToolsProtocol",
    "guarded_protocol",
    "last_activity",
    "unsent_bytes",
]
