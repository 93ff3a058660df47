"""`lmdctl reload` on a running daemon: load the config file and the environment again
(the command line stays as it was).

Live keys (config_loader.LIVE_KEYS: log level, API keys, request size limit) apply at
once, in the supervisor and in every worker (a Reconfigure message); a restarted or
added worker starts with them too. Other changed keys keep their running value and are
reported as needing a restart. A bad file changes nothing (400 bad_config).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any

from lmd import protocol
from lmd.config import ConfigError
from lmd.config_loader import reload_config
from lmd.supervisor.control import ControlError
from lmd.supervisor.states import DaemonState
from lmd.worker import set_log_level

if TYPE_CHECKING:
    from lmd.supervisor.supervisor import Supervisor

log = logging.getLogger(__name__)


async def reload(sup: Supervisor) -> dict[str, Any]:
    if sup.state in (DaemonState.STARTING, DaemonState.STOPPING):
        raise ControlError(409, str(sup.state), f"the daemon is {sup.state}; try later")
    with sup.service.reloading(lambda: sup.status_line):
        try:
            sup.loaded, plan = reload_config(sup.loaded)
        except ConfigError as exc:
            raise ControlError(400, "bad_config", str(exc)) from None
        sup.config = sup.loaded.config
        for child in sup.children.values():  # what a restarted worker runs with
            child.spec = dataclasses.replace(child.spec, config=sup.config.to_dict())
        set_log_level(sup.config.log_level)
        if plan.applied:
            live = {k: getattr(sup.config, k) for k in plan.applied}
            await sup.broadcast(protocol.Reconfigure(live))
    log.info(
        "config reloaded: applied %s; needs a restart: %s",
        ", ".join(plan.applied) or "nothing",
        ", ".join(plan.needs_restart) or "nothing",
    )
    return {"ok": True, "file": sup.loaded.to_json()["file"], **plan.to_json()}
