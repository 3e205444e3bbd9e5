"""Admin routes: show and reload the policy, reload the quality gate report.

They only ever open files inside the directories the server was configured with (the policy's and the
shipped policies; the gate report's and the shipped reports), so a request cannot make the server read,
or echo in an error, any other file it can reach. On a non-loopback bind without an API key they are
closed (403) unless the operator opened them explicitly (``--unauthenticated-admin``).
"""

from __future__ import annotations

import logging
from pathlib import Path

from flask import Blueprint, jsonify, request

from ..controller.quality import runs
from ..yamlconf import ConfigError
from .context import ctx
from .errors import ApiError
from .openapi import GateInfo, Operation, PolicyInfo, route
from .schemas import PolicyReload, parse

log = logging.getLogger(__name__)
bp = Blueprint("admin", __name__, url_prefix="/admin")
POLICY_SUFFIXES = (".yaml", ".yml")
REPORT_SUFFIXES = (".json",)


@bp.before_request
def _guard():
    c = ctx()
    if c.admin_exposed and not c.http.unauthenticated_admin:
        raise ApiError(403, f"admin routes are closed: the server listens on {c.http.host} without an API key "
                       "(start it with --api-key, or --unauthenticated-admin to open them anyway)",
                       code="admin_disabled")


def confined(given: str, dirs: tuple[Path, ...], suffixes: tuple[str, ...], what: str) -> Path:
    """``given`` (absolute, or relative to the working directory or to one of ``dirs``) as a path inside
    ``dirs`` with one of ``suffixes``; anything else is refused before the file is opened."""
    roots = [d.resolve() for d in dirs]
    path = Path(given)
    candidates = [path] if path.is_absolute() else [Path.cwd() / path, *(d / path for d in roots)]
    inside = [c.resolve() for c in candidates
              if c.suffix in suffixes and any(c.resolve().is_relative_to(r) for r in roots)]
    if not inside:
        raise ApiError(400, f"{what} must be a {'/'.join(suffixes)} file in {', '.join(map(str, roots))}",
                       param="path", code="path_not_allowed")
    return next((p for p in inside if p.is_file()), inside[0])


def reload_path(dirs: tuple[Path, ...], suffixes: tuple[str, ...], what: str) -> Path | None:
    """The confined ``{"path": ...}`` of an admin reload; None (empty body) re-reads the current file."""
    data = request.get_json(silent=True, force=True) if request.data else {}
    if data is None:
        raise ApiError(400, 'body must be empty or {"path": "..."}', param="path")
    given = parse(PolicyReload, data).path
    return confined(given, dirs, suffixes, what) if given else None


@route(bp, "post", "/gate", Operation("Reload the quality gate report; a broken file changes nothing", GateInfo,
                                     PolicyReload, body_required=False, errors=(400, 403)))
def reload_gate():
    """Re-read the quality gate report (or another report in the reports directories)."""
    c = ctx()
    controller = c.service.controller
    try:
        report = controller.load_quality_report(reload_path(c.report_dirs, REPORT_SUFFIXES, "a gate report"))
    except ConfigError as exc:
        raise ApiError(400, f"gate report not changed: {exc}", param="path", code="invalid_gate_report") from None
    scored = runs(report)
    return jsonify({"report": str(controller.quality_report_path), "date": scored[-1].get("date"),
                    "runs": len(scored), "modes": sorted({m for r in scored for m in r["modes"]})})


@route(bp, "get", "/policy", Operation("The routing policy in force", PolicyInfo, errors=(403,)))
def get_policy():
    return jsonify(ctx().service.controller.policy.describe())


@route(bp, "post", "/policy", Operation("Reload the policy (its file, or another in the policy directories); a "
                                       "broken file changes nothing", PolicyInfo, PolicyReload,
                                       body_required=False, errors=(400, 403)))
def reload_policy():
    c = ctx()
    try:
        policy = c.service.controller.reload(reload_path(c.policy_dirs, POLICY_SUFFIXES, "a policy"))
    except ConfigError as exc:
        raise ApiError(400, f"policy not changed: {exc}", param="path", code="invalid_policy") from None
    log.info("policy reloaded: %s from %s", policy.name, policy.source)
    return jsonify(policy.describe())
