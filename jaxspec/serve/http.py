"""uvicorn's HTTP protocol with OpenAI-style JSON bodies for malformed framing.

A request whose framing is broken (a non-numeric Content-Length, bad chunked
encoding) is refused by uvicorn's h11 parser before the app sees it, and
uvicorn answers with a plain-text 400. Clients of an OpenAI-compatible server
parse error bodies as JSON, so this subclass sends the same 400 with the error
body every other refusal of the server has. `send_400_response` is uvicorn's
own hook for exactly this reply (0.3x to 0.54 at least); if a uvicorn release
drops it, `http_protocol()` falls back to the stock protocol (plain text),
which is still a 400 and never a hang.
"""

from __future__ import annotations

import json


def http_protocol():
    """The protocol class to pass as uvicorn's `http=`, or "h11" if it cannot be built."""
    try:
        import h11
        from uvicorn.protocols.http.h11_impl import H11Protocol
    except ImportError:
        return "h11"
    if not hasattr(H11Protocol, "send_400_response"):
        return "h11"

    class JSONErrorH11Protocol(H11Protocol):
        def send_400_response(self, msg: str) -> None:
            body = json.dumps({"error": {"message": f"malformed HTTP request: {msg}", "type": "invalid_request_error",
                                         "param": None, "code": None}}).encode()
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                       (b"connection", b"close")]
            for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body),
                          h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
            self.transport.close()

    return JSONErrorH11Protocol
