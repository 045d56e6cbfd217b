"""Issue 43.10: a row's file (an image) is read bounded in size and time, only when it can end, and
each bad row gets its true reason (before: a 3 GB file read whole, /dev/zero unbounded, a FIFO
blocking until the chunk was killed as hung, a silent URL costing ten minutes, and both it and a
redirect loop reported as "no such file")."""

from __future__ import annotations

import http.server
import json
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from chunkq.jobs.contract.row_files import RowReadError, read_row_file


def _reason(ref: str, **bounds: float) -> str:
    with pytest.raises(RowReadError) as failed:
        read_row_file(ref, **bounds)  # type: ignore[arg-type]
    return str(failed.value)


def test_local_files_are_read_when_they_are_regular_and_small_enough(tmp_path: Path) -> None:
    small = tmp_path / "a.png"
    small.write_bytes(b"x" * 1000)
    assert read_row_file(str(small)) == b"x" * 1000
    big = tmp_path / "big.tif"
    with open(big, "wb") as fh:
        fh.truncate(3 << 30)  # 3 GiB, sparse: a read of it whole would take that much memory
    assert _reason(str(big)) == "3.0 GiB, larger than the 64.0 MiB a row's file may be"
    assert _reason(str(small), max_bytes=512) == "1000 B, larger than the 512 B a row's file may be"
    assert _reason(str(tmp_path / "gone.png")) == "no such file"
    assert _reason(str(tmp_path)) == "not a regular file: a directory"
    fifo = tmp_path / "pipe.png"
    os.mkfifo(fifo)  # no writer: a blocking open would wait forever
    assert _reason(str(fifo)) == "not a regular file: a FIFO (it may never end)"
    assert _reason("/dev/zero") == "not a regular file: a character device (it may never end)"
    assert "ftp:// is not read" in _reason("ftp://example.org/a.png")


class _Handler(http.server.BaseHTTPRequestHandler):
    hang = threading.Event()

    def do_GET(self) -> None:
        if self.path == "/image.png":
            body = b"y" * 5000
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        elif self.path == "/loop":
            self.send_response(302)
            self.send_header("Location", "/loop")
            self.end_headers()
        elif self.path == "/ftp":
            self.send_response(302)
            self.send_header("Location", "ftp://example.org/x")
            self.end_headers()
        elif self.path == "/silent":
            self.hang.wait(30)  # answers nothing until the test ends
        elif self.path == "/huge":
            self.send_response(200)
            self.send_header("Content-Length", str(1 << 40))
            self.end_headers()
        else:
            self.send_error(404)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        _Handler.hang.set()
        httpd.shutdown()
        httpd.server_close()
        _Handler.hang.clear()


def test_urls_are_read_within_their_time_and_size_and_each_failure_says_why(server: str) -> None:
    assert read_row_file(f"{server}/image.png") == b"y" * 5000
    assert _reason(f"{server}/missing.png") == "HTTP 404 Not Found"
    assert "a redirect loop" in _reason(f"{server}/loop")
    assert "redirected to ftp://, which is not read" in _reason(f"{server}/ftp")
    assert _reason(f"{server}/silent", seconds=0.5) == "no answer within 0.5 s"
    assert _reason(f"{server}/huge") == "1.0 TiB, larger than the 64.0 MiB a row's file may be"
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    assert _reason(f"http://127.0.0.1:{port}/a.png") == "connection refused"


@pytest.mark.slow
def test_an_image_run_with_fifos_and_endless_files_keeps_its_good_rows(
    tmp_path: Path, store: Path, connection: Any
) -> None:
    """Before: two FIFOs made the chunk hang until it was killed, and its good rows were lost despite
    --allow-missing. Now they are bad rows with their reasons, and the result is the good rows'
    ``SentenceTransformer.encode``, row for row."""
    from PIL import Image
    from sentence_transformers import SentenceTransformer

    from chunkq.jobs.contract.specs import EncodeOptions
    from tests.helpers import max_abs_diff, result_of, run_in_process
    from tests.tiny_models import tiny_clip

    model = tiny_clip(tmp_path / "clip")
    refs, images = [], []
    for i in range(4):
        path = tmp_path / f"img{i}.png"
        Image.new("RGB", (24 + i, 20), (60 * i, 90, 200)).save(path)
        refs.append(str(path))
        images.append(Image.open(path))
    for name in ("a.fifo", "b.fifo"):
        os.mkfifo(tmp_path / name)
    refs[1:1] = [str(tmp_path / "a.fifo"), "/dev/zero", str(tmp_path / "b.fifo")]
    ids = [f"r{i}" for i in range(len(refs))]
    layout, _, _ = run_in_process(
        tmp_path, store, connection, ids, refs, "images", model=str(model),
        encode=EncodeOptions(kind="image", allow_missing=True), cache=False,
    )  # fmt: skip
    got, got_ids = result_of(layout)
    assert got_ids == ["r0", "r4", "r5", "r6"]
    assert max_abs_diff(got, SentenceTransformer(str(model), device="cpu").encode(images)) <= 1e-5
    left_out = {r["id"]: r["reason"] for r in json.loads(layout.result_manifest.read_text())["bad_rows"]}
    assert left_out == {
        "r1": f"{tmp_path / 'a.fifo'}: not a regular file: a FIFO (it may never end)",
        "r2": "/dev/zero: not a regular file: a character device (it may never end)",
        "r3": f"{tmp_path / 'b.fifo'}: not a regular file: a FIFO (it may never end)",
    }
