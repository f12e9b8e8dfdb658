"""A local HTTP server speaking the subset of the Hugging Face Hub API that ``specray push``
(trainer/hub.py, through huggingface_hub 2.4) calls; what it stores it serves back, so a push can
be verified against it. Loopback only, in memory, a thread per request.

    server = MockHub(token="hf_test")            # http://127.0.0.1:<port>
    python tests/trainer/hub_server.py --token hf_test   # the same, as a process (prints the push command)
    HF_ENDPOINT=$server.url HF_HUB_DISABLE_XET=1 specray push EXPORT --repo me/drafter --token hf_test

Endpoints (model repos): ``POST /api/repos/create``, ``POST /api/validate-yaml``,
``POST /api/models/{repo}/branch/{branch}``, ``POST /api/models/{repo}/preupload/{rev}``,
``POST /{repo}.git/info/lfs/objects/batch`` (basic transfer: ``PUT /lfs/{oid}``, ``POST
/lfs/verify``), ``POST /api/models/{repo}/commit/{rev}`` (ndjson), ``GET
/api/models/{repo}/tree/{rev}`` and ``POST /api/models/{repo}/paths-info/{rev}``. Binary files and
``*.safetensors`` go through LFS, as on the Hub. Every request needs ``Authorization: Bearer
<token>`` (401 otherwise), but an LFS upload, whose URL is presigned as the Hub's are. ``corrupt``
names paths whose stored content the server alters after a commit (a lying store: the push's
verification must catch it).
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlparse

import yaml

GITATTRIBUTES = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"


def blob_id(content: bytes) -> str:
    """git's blob id: sha1 of ``blob <size>\\0`` + content."""
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


class MockHub:
    def __init__(self, token: str):
        self.token = token
        self.repos: dict[str, dict] = {}  # repo id -> {"private": bool, "branches": {name: {path: (bytes, lfs)}}}
        self.lfs: dict[str, bytes] = {}  # sha256 -> content
        self.corrupt: set[str] = set()
        self.requests: list[str] = []
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def signature(self, path: str) -> str:
        """The Hub's LFS upload URLs are presigned (the PUT carries no token): a signature of the path."""
        return hashlib.sha256(f"{self.token}:{path}".encode()).hexdigest()[:16]

    def files(self, repo: str, branch: str = "main") -> dict[str, bytes]:
        return {path: content for path, (content, _) in self.repos[repo]["branches"][branch].items()}

    # -- request handling ---------------------------------------------------------------------

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    chunks = []
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                        if size == 0:
                            self.rfile.readline()
                            return b"".join(chunks)
                        chunks.append(self.rfile.read(size))
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _reply(self, status: int, body=None, headers: dict | None = None) -> None:
                data = b"" if body is None else json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

            def _route(self, method: str) -> None:
                url = urlparse(self.path)
                body = self._body() if method in ("POST", "PUT") else b""
                hub.requests.append(f"{method} {url.path}")
                presigned = method == "PUT" and parse_qs(url.query).get("sig") == [hub.signature(url.path)]
                if not presigned and self.headers.get("Authorization") != f"Bearer {hub.token}":
                    return self._reply(401, {"error": "Invalid credentials in Authorization header"})
                with hub.lock:
                    status, reply = hub.dispatch(method, url.path, parse_qs(url.query), body,
                                                 self.headers.get("Content-Type", ""))
                self._reply(status, reply)

            def do_GET(self):
                self._route("GET")

            def do_POST(self):
                self._route("POST")

            def do_PUT(self):
                self._route("PUT")

        return Handler

    def dispatch(self, method: str, path: str, query: dict, body: bytes, content_type: str):
        routes = [
            ("POST", r"/api/repos/create", self._create),
            ("POST", r"/api/validate-yaml", self._validate_yaml),
            ("POST", r"/api/models/(?P<repo>[^/]+/[^/]+)/branch/(?P<rev>.+)", self._branch),
            ("POST", r"/api/models/(?P<repo>[^/]+/[^/]+)/preupload/(?P<rev>.+)", self._preupload),
            ("POST", r"/(?P<repo>[^/]+/[^/]+)\.git/info/lfs/objects/batch", self._lfs_batch),
            ("PUT", r"/lfs/(?P<oid>[0-9a-f]{64})", self._lfs_put),
            ("POST", r"/lfs/verify", self._lfs_verify),
            ("POST", r"/api/models/(?P<repo>[^/]+/[^/]+)/commit/(?P<rev>.+)", self._commit),
            ("GET", r"/api/models/(?P<repo>[^/]+/[^/]+)/tree/(?P<rev>[^/]+)", self._tree),
            ("POST", r"/api/models/(?P<repo>[^/]+/[^/]+)/paths-info/(?P<rev>.+)", self._paths_info),
        ]
        for verb, pattern, handler in routes:
            match = re.fullmatch(pattern, path)
            if verb == method and match:
                args = {k: unquote(v) for k, v in match.groupdict().items()}
                return handler(body=body, query=query, content_type=content_type, **args)
        return 404, {"error": f"no route {method} {path}"}

    def _branch_files(self, repo: str, rev: str):
        if repo not in self.repos:
            return None, (404, {"error": f"Repository {repo} not found"})
        if rev not in self.repos[repo]["branches"]:
            return None, (404, {"error": f"Revision {rev} not found"})
        return self.repos[repo]["branches"][rev], None

    def _create(self, body: bytes, **_):
        payload = json.loads(body)
        repo = f"{payload['organization']}/{payload['name']}" if payload.get("organization") else payload["name"]
        if repo in self.repos:  # the Hub names the existing repo's url in its 409 (create_repo(exist_ok) reads it)
            return 409, {"error": "You already created this model repo", "url": f"{self.url}/{repo}"}
        private = payload.get("private", payload.get("visibility") == "private")
        self.repos[repo] = {"private": bool(private), "branches": {"main": {".gitattributes": (GITATTRIBUTES, False)}}}
        return 200, {"url": f"{self.url}/{repo}", "name": repo}

    def _validate_yaml(self, body: bytes, **_):
        content = json.loads(body)["content"]
        match = re.match(r"^---\n(.*?)\n---\n", content, re.S)
        try:
            yaml.safe_load(match.group(1) if match else "")
        except yaml.YAMLError as e:
            return 400, {"errors": [{"message": str(e)}], "warnings": []}
        return 200, {"errors": [], "warnings": [] if match else [{"message": "empty metadata"}]}

    def _branch(self, repo: str, rev: str, body: bytes, **_):
        files, error = self._branch_files(repo, "main")
        if error:
            return error
        if rev in self.repos[repo]["branches"]:
            return 409, {"error": f"Reference {rev} already exists"}
        self.repos[repo]["branches"][rev] = dict(files)
        return 200, {}

    def _preupload(self, repo: str, rev: str, body: bytes, **_):
        _, error = self._branch_files(repo, rev)
        if error:
            return error
        modes = []
        for f in json.loads(body)["files"]:
            sample = base64.b64decode(f["sample"])
            lfs = f["path"].endswith(".safetensors") or b"\0" in sample
            modes.append({"path": f["path"], "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False})
        return 200, {"files": modes}

    def _lfs_batch(self, repo: str, body: bytes, **_):
        objects = []
        for obj in json.loads(body)["objects"]:
            actions = None if obj["oid"] in self.lfs else {
                "upload": {"href": f"{self.url}/lfs/{obj['oid']}?sig={self.signature('/lfs/' + obj['oid'])}"},
                "verify": {"href": f"{self.url}/lfs/verify"}}
            objects.append({"oid": obj["oid"], "size": obj["size"], **({"actions": actions} if actions else {})})
        return 200, {"transfer": "basic", "objects": objects}

    def _lfs_put(self, oid: str, body: bytes, **_):
        if hashlib.sha256(body).hexdigest() != oid:
            return 400, {"error": "sha256 of the uploaded content differs from the oid"}
        self.lfs[oid] = body
        return 200, None

    def _lfs_verify(self, body: bytes, **_):
        obj = json.loads(body)
        ok = obj["oid"] in self.lfs and len(self.lfs[obj["oid"]]) == obj["size"]
        return (200, {}) if ok else (404, {"error": "object not uploaded"})

    def _commit(self, repo: str, rev: str, body: bytes, **_):
        files, error = self._branch_files(repo, rev)
        if error:
            return error
        changes = {}
        for line in body.splitlines():
            item = json.loads(line)
            value = item["value"]
            if item["key"] == "file":
                changes[value["path"]] = (base64.b64decode(value["content"]), False)
            elif item["key"] == "lfsFile":
                if value["oid"] not in self.lfs:
                    return 400, {"error": f"LFS object {value['oid']} of {value['path']} was not uploaded"}
                changes[value["path"]] = (self.lfs[value["oid"]], True)
            elif item["key"] == "deletedFile":
                changes[value["path"]] = None
        for path, entry in changes.items():
            if entry is None:
                files.pop(path, None)
            else:
                files[path] = entry
        for path in self.corrupt & set(files):  # the store loses a byte; the commit still reports success
            content, lfs = files[path]
            files[path] = (content[:-1], lfs)
        oid = hashlib.sha1(body).hexdigest()
        return 200, {"commitUrl": f"{self.url}/{repo}/commit/{oid}", "commitOid": oid}

    def _entry(self, path: str, content: bytes, lfs: bool) -> dict:
        entry = {"type": "file", "path": path, "size": len(content), "oid": blob_id(content)}
        if lfs:
            entry["lfs"] = {"oid": hashlib.sha256(content).hexdigest(), "size": len(content), "pointerSize": 134}
        return entry

    def _tree(self, repo: str, rev: str, **_):
        files, error = self._branch_files(repo, rev)
        if error:
            return error
        return 200, [self._entry(p, c, lfs) for p, (c, lfs) in sorted(files.items())]

    def _paths_info(self, repo: str, rev: str, body: bytes, content_type: str, **_):
        files, error = self._branch_files(repo, rev)
        if error:
            return error
        form = json.loads(body) if "json" in content_type else {k: v for k, v in parse_qs(body.decode()).items()}
        paths = form.get("paths", [])
        return 200, [self._entry(p, *files[p]) for p in paths if p in files]


if __name__ == "__main__":  # python tests/trainer/hub_server.py --token hf_local: serves until Ctrl-C
    import argparse

    parser = argparse.ArgumentParser(description="a local Hub-API server for `specray push` (in memory)")
    parser.add_argument("--token", required=True, help="the token clients must send")
    hub = MockHub(token=parser.parse_args().token)
    print(f"HF_ENDPOINT={hub.url} HF_HUB_DISABLE_XET=1 specray push EXPORT --repo me/drafter --token ...", flush=True)
    try:
        hub.thread.join()
    except KeyboardInterrupt:
        hub.close()
