"""A size limit on a request's head (request line and headers) for the uvicorn servers.

uvicorn's httptools protocol keeps no limit of its own: a 10 MB header was read whole and
answered 200. This protocol counts the bytes received while a request's head is still being
parsed and, past `max_bytes`, answers 431 in OpenAI's error shape and closes the connection, so
memory per connection stays within the limit and one read. Bodies are not counted here
(http_limits.BodyLimit does that).
"""

from __future__ import annotations

import json

from llmserve.openai.errors import error_body

DEFAULT_MAX_HEADER_BYTES = 64 << 10  # nginx's default head buffers hold 32 KiB, Node's 16 KiB


def head_limited_http(max_bytes: int = DEFAULT_MAX_HEADER_BYTES) -> type:
    """uvicorn's httptools protocol with the limit: pass as `uvicorn.Config(http=...)`."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class HeadLimitedHttpTools(HttpToolsProtocol):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self._in_head = True  # a request's head is being read (no request yet counts as one)
            self._read = 0  # bytes received while the head did not end (heads over several reads)
            self._parsed = 0  # bytes of the URL and headers parsed (a head within one read)
            self._too_large = False
            self._began = False  # a request began during the current read

        def data_received(self, data: bytes) -> None:
            counting, self._began = self._in_head, False
            super().data_received(data)
            # the head goes on past this read; a read in which a request began may hold the body of
            # the one before (pipelined): not counted, the head's next reads are (and `_parsed` is)
            if counting and self._in_head and not self._began and not self.transport.is_closing():
                self._read += len(data)
                if self._read > max_bytes:
                    self._refuse()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._in_head, self._read, self._parsed, self._began = True, 0, 0, True

        def on_url(self, url: bytes) -> None:
            self._count(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._count(len(name) + len(value) + 4)
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._in_head = False
            super().on_headers_complete()

        def _count(self, size: int) -> None:
            self._parsed += size
            if self._parsed > max_bytes:
                self._too_large = True
                raise HeadTooLarge()  # stops the parser; uvicorn answers a parser error with send_400_response

        def send_400_response(self, msg: str) -> None:
            if self._too_large:
                self._refuse()
            else:
                super().send_400_response(msg)

        def _refuse(self) -> None:
            body = json.dumps(error_body(431, f"the request's headers are larger than {max_bytes} bytes",
                                         code="headers_too_large")).encode()  # fmt: skip
            head = (b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
                    b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n")  # fmt: skip
            self.transport.write(head + body)
            self.transport.close()

    return HeadLimitedHttpTools


class HeadTooLarge(Exception):
    """Raised in a parser callback: the head passed the limit."""
