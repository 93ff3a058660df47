"""Whether the api can serve a completion: the one readiness rule of /health, /v1/models
and the completion routes (issue 18: no 200 from /v1/models before a completion can be
answered)."""

from __future__ import annotations

from typing import Any

from lmd.api.openai_schema import ApiError

RETRY_AFTER_S = 5  # while the daemon starts, drains or restarts a role


def health(
    draining: bool, cluster_state: str, missing_roles: list[str]
) -> tuple[int, dict[str, Any]]:
    """(HTTP status, body): 200 only when the daemon runs and every role is up; a 503
    names the roles with no running worker (`missing_roles`, when there are any)."""
    roles = ", ".join(missing_roles)
    if draining or cluster_state == "draining":
        status, reason = "draining", "the daemon is draining"
    elif cluster_state != "running":
        status, reason = cluster_state, f"daemon is {cluster_state}"
        if roles:
            reason += f"; no running worker yet for: {roles}"
    elif roles:
        status, reason = "degraded", f"no running worker for: {roles}"
    else:
        return 200, {"status": "ok"}
    body: dict[str, Any] = {"status": status, "reason": reason}
    if missing_roles:
        body["missing_roles"] = missing_roles
    return 503, body


def unavailable(health: tuple[int, dict[str, Any]]) -> ApiError | None:
    """The 503 (with Retry-After) of every route that needs the engines, the model list
    included, while the daemon cannot serve a completion; None when it can."""
    status, state = health
    if status == 200:
        return None
    reason = f"{state['reason']}; retry later"
    return ApiError(503, reason, type="service_unavailable", retry_after_s=RETRY_AFTER_S)
