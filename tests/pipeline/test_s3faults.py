"""The S3 fault proxy in front of the real S3 server (SeaweedFS), used through s3fs as the
registry and the feature store use it."""

import os
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

import httpx2
import pytest
import s3fs

from specray.pipeline.bench.s3faults import S3FaultProxy


def _fs(endpoint: str) -> s3fs.S3FileSystem:
    """A client that gives up at once (one botocore attempt, one s3fs try), so an outage shows."""
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint}, config_kwargs={"retries": {"max_attempts": 1}},
                           skip_instance_cache=True, use_listings_cache=False)
    fs.retries = 1
    return fs


def test_the_upstream_must_be_a_plain_http_endpoint():
    with pytest.raises(ValueError, match="http://host:port"):
        S3FaultProxy("https://s3.amazonaws.com")
    with pytest.raises(ValueError, match="no path"):
        S3FaultProxy("http://127.0.0.1:8333/bucket")
    with pytest.raises(ValueError, match="> 0 seconds"):
        S3FaultProxy("http://127.0.0.1:8333").outage(0)


@pytest.mark.s3
def test_requests_pass_through_and_are_refused_during_an_outage(seaweedfs):
    bucket = seaweedfs.bucket
    with S3FaultProxy(seaweedfs.endpoint) as proxy:
        assert proxy.endpoint_url.startswith("http://127.0.0.1:")
        fs = _fs(proxy.endpoint_url)
        payload = os.urandom(11 << 20)
        with fs.open(f"{bucket}/proxied/multipart", "wb", block_size=5 << 20) as f:  # signed uploads, 3 parts
            f.write(payload)
        fs.pipe_file(f"{bucket}/proxied/small", b"hello")
        assert fs.cat_file(f"{bucket}/proxied/multipart") == payload
        assert sorted(fs.ls(f"{bucket}/proxied", detail=False)) == [f"{bucket}/proxied/multipart",
                                                                   f"{bucket}/proxied/small"]
        assert _fs(seaweedfs.endpoint).cat_file(f"{bucket}/proxied/small") == b"hello"  # it reached the server
        forwarded = proxy.counts()["forwarded"]
        assert {"PUT", "POST", "GET", "HEAD"} <= set(proxy.first_request_at)  # multipart uploads POST
        assert proxy.last_request_at >= max(proxy.first_request_at.values())
        assert forwarded >= 7 and proxy.counts()["refused"] == 0

        proxy.outage(2.0)
        assert proxy.in_outage()
        with pytest.raises(OSError, match="Service Unavailable|reduce your request rate"):
            fs.cat_file(f"{bucket}/proxied/small")
        with pytest.raises(OSError, match="Service Unavailable|reduce your request rate"):
            fs.pipe_file(f"{bucket}/proxied/refused", b"x")
        counts = proxy.counts()
        assert counts["refused"] >= 2 and counts["forwarded"] == forwarded and counts["upstream_errors"] == 0

        time.sleep(max(0.0, proxy.outages[-1][1] - time.monotonic()) + 0.05)
        assert not proxy.in_outage()
        assert fs.cat_file(f"{bucket}/proxied/small") == b"hello"
        assert not _fs(seaweedfs.endpoint).exists(f"{bucket}/proxied/refused")
        assert proxy.counts()["forwarded"] > forwarded
        port = int(proxy.endpoint_url.rsplit(":", 1)[1])
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=2):  # stopped: nothing listens
        pass


@pytest.mark.s3
def test_an_outage_answers_with_s3_slowdown_and_a_client_with_retries_outlasts_a_short_one(seaweedfs):
    with S3FaultProxy(seaweedfs.endpoint) as proxy:
        proxy.outage(1.0)
        response = httpx2.get(f"{proxy.endpoint_url}/{seaweedfs.bucket}/ready", trust_env=False)
        assert response.status_code == 503 and "<Code>SlowDown</Code>" in response.text
        fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": proxy.endpoint_url}, skip_instance_cache=True)
        assert fs.cat_file(f"{seaweedfs.bucket}/ready") == b"1"  # botocore's and s3fs's retries back off past it
        assert proxy.counts()["refused"] >= 2 and proxy.counts()["forwarded"] >= 1


def test_an_unreachable_upstream_is_answered_502():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    with S3FaultProxy(f"http://127.0.0.1:{port}") as proxy:
        response = httpx2.put(f"{proxy.endpoint_url}/bucket/key", content=b"data", trust_env=False)
        assert response.status_code == 502 and proxy.counts() == {"forwarded": 0, "refused": 0, "upstream_errors": 1}


def test_a_chunked_body_and_the_host_header_are_forwarded_as_sent():
    seen = {}

    class Upstream(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_PUT(self):
            seen["host"], seen["encoding"] = self.headers["Host"], self.headers["Transfer-Encoding"]
            seen["raw"] = self.rfile.read(len(b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"))
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args):
            pass

    upstream = HTTPServer(("127.0.0.1", 0), Upstream)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    try:
        with S3FaultProxy(f"http://127.0.0.1:{upstream.server_address[1]}") as proxy:
            response = httpx2.put(f"{proxy.endpoint_url}/bucket/key", content=iter([b"abc", b"de"]), trust_env=False)
            assert response.status_code == 200 and response.content == b"ok"
            assert seen == {"host": proxy.endpoint_url.removeprefix("http://"), "encoding": "chunked",
                            "raw": b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"}
    finally:
        upstream.shutdown()
        upstream.server_close()
