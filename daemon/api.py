"""The api process: the HTTP front on --host/--port (FastAPI on uvicorn + uvloop).

For now it answers `GET /health` (from the ClusterState the supervisor pushes) and
`GET /v1/models`; the OpenAI generation endpoints arrive with the tokenizer issue.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import FastAPI

from lmd import __version__
from lmd.http_server import BindError, EmbeddedServer, JSONResponse, bind_tcp
from lmd.worker import Worker, WorkerStartError


class ApiWorker(Worker):
    role = "api"

    async def start(self) -> None:
        try:
            sock = bind_tcp(self.config.host, self.config.port)
        except BindError as exc:
            raise WorkerStartError(str(exc)) from None
        self.created = int(time.time())
        self.server = EmbeddedServer(self.build_app(), sock, self.config.log_level)
        await self.server.start()

    async def stop(self) -> None:
        await self.server.stop()

    def info(self) -> dict[str, Any]:
        return {"listen": f"http://{self.config.host}:{self.config.port}"}

    def health(self) -> tuple[int, dict[str, Any]]:
        """(HTTP status, body): 200 only when the daemon runs and every role is up."""
        if self.draining or self.cluster_state == "draining":
            return 503, {"status": "draining", "reason": "the daemon is draining"}
        if self.cluster_state != "running":
            return 503, {"status": self.cluster_state, "reason": f"daemon is {self.cluster_state}"}
        if self.missing_roles:
            missing = ", ".join(self.missing_roles)
            return 503, {"status": "degraded", "reason": f"no running worker for: {missing}"}
        return 200, {"status": "ok"}

    def build_app(self) -> FastAPI:
        app = FastAPI(title="lmd", version=__version__, default_response_class=JSONResponse)

        @app.get("/health")
        async def health() -> JSONResponse:
            status, body = self.health()
            return JSONResponse(body, status_code=status)

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            card = {
                "id": self.config.served_model_name,
                "object": "model",
                "created": self.created,
                "owned_by": "lmd",
            }
            return {"object": "list", "data": [card]}

        return app
