"""A local HTTP server speaking the parts of the Hugging Face Hub API that pushing and pulling a model repo use.

Repositories live in memory. Uploads are accepted as regular (inline base64) files: the preupload answer tells
the client so, which keeps LFS/Xet storage out of the picture. Used by the tests, never the internet.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse


class FakeHub:
    """``with FakeHub() as hub: ... endpoint=hub.url``; ``hub.repos[repo_id]`` maps paths to bytes."""

    def __init__(self) -> None:
        self.repos: dict[str, dict[str, bytes]] = {}
        self.commits: dict[str, str] = {}
        self.unhandled: list[str] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # keep test output clean
                pass

            def _send(self, code: int, body: bytes = b"", headers: dict | None = None, content_type="application/json"):
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _json(self, code: int, obj) -> None:
                self._send(code, json.dumps(obj).encode())

            def _body(self) -> bytes:
                return self.rfile.read(int(self.headers.get("Content-Length", 0) or 0))

            def do_POST(self) -> None:  # noqa: N802
                path = unquote(urlparse(self.path).path)
                body = self._body()
                if path == "/api/repos/create":
                    data = json.loads(body or b"{}")
                    repo_id = f"{data['organization']}/{data['name']}" if data.get("organization") else data["name"]
                    hub.repos.setdefault(repo_id, {})
                    hub.commits.setdefault(repo_id, "0" * 40)
                    return self._json(200, {"url": f"{hub.url}/{repo_id}", "name": repo_id})
                if path == "/api/validate-yaml":  # model card metadata check
                    return self._json(200, {"errors": [], "warnings": []})
                m = re.fullmatch(r"/api/models/(.+)/preupload/[^/]+", path)
                if m:
                    files = json.loads(body)["files"]
                    return self._json(200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]})
                m = re.fullmatch(r"/api/models/(.+)/commit/[^/]+", path)
                if m:
                    repo_id = m.group(1)
                    for line in body.decode().splitlines():
                        item = json.loads(line)
                        if item["key"] == "file":
                            hub.repos[repo_id][item["value"]["path"]] = base64.b64decode(item["value"]["content"])
                    sha = hashlib.sha1(json.dumps(sorted(hub.repos[repo_id])).encode() + body).hexdigest()
                    hub.commits[repo_id] = sha
                    return self._json(200, {"commitUrl": f"{hub.url}/{repo_id}/commit/{sha}", "commitOid": sha})
                hub.unhandled.append(f"POST {path}")
                self._json(404, {"error": "not found"})

            def do_GET(self) -> None:  # noqa: N802
                path = unquote(urlparse(self.path).path)
                m = re.fullmatch(r"/api/models/(.+)/tree/[^/]+(?:/.*)?", path)
                if m and m.group(1) in hub.repos:
                    files = sorted(hub.repos[m.group(1)].items())
                    entries = [{"type": "file", "path": p, "size": len(b), "oid": hashlib.sha1(b).hexdigest()} for p, b in files]
                    return self._json(200, entries)
                m = re.fullmatch(r"/api/models/(.+?)(?:/revision/[^/]+)?", path)
                if m and m.group(1) in hub.repos:
                    repo_id = m.group(1)
                    siblings = [{"rfilename": p, "size": len(b)} for p, b in sorted(hub.repos[repo_id].items())]
                    return self._json(200, {"id": repo_id, "modelId": repo_id, "sha": hub.commits[repo_id], "siblings": siblings, "private": False})
                m = re.fullmatch(r"/(.+)/resolve/([^/]+)/(.+)", path)
                if m and m.group(1) in hub.repos and m.group(3) in hub.repos[m.group(1)]:
                    data = hub.repos[m.group(1)][m.group(3)]
                    etag = hashlib.sha256(data).hexdigest()
                    headers = {"ETag": f'"{etag}"', "X-Repo-Commit": hub.commits[m.group(1)]}
                    return self._send(200, data, headers, "application/octet-stream")
                hub.unhandled.append(f"{self.command} {path}")
                self._json(404, {"error": "not found"})

            do_HEAD = do_GET

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        import huggingface_hub.constants

        # A machine set offline (HF_HUB_OFFLINE=1, as bench/gpu_session.sh sets on a lent GPU) still reaches this
        # local server: the Hub client refuses every request while the flag is up.
        self._offline = huggingface_hub.constants.HF_HUB_OFFLINE
        huggingface_hub.constants.HF_HUB_OFFLINE = False
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        import huggingface_hub.constants

        huggingface_hub.constants.HF_HUB_OFFLINE = self._offline
        self._server.shutdown()
        self._server.server_close()
