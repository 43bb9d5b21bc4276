"""A streamed answer's response: whatever happens to it (a client gone before the first byte, whose
stream was then never started, included), the request's end runs once: its adapter lease let go,
its token reservation settled (ChatService.end)."""

from __future__ import annotations

from starlette.responses import StreamingResponse

from services.explorer.serving.prepare import PreparedChat, recorded_header


class EndingStream(StreamingResponse):
    def __init__(self, content, prepared: PreparedChat, chat):
        super().__init__(content, media_type="text/event-stream", headers={
            "Cache-Control": "no-cache", "X-Accel-Buffering": "no", **recorded_header(prepared)})
        self._prepared, self._chat = prepared, chat

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._chat.end(self._prepared)
