"""A small synchronous client of the gateway's HTTP API. Every failure becomes a CliError whose message
is the API's own (`{"error": {"message": ...}}`) or says plainly why the gateway could not be reached."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from urllib.parse import quote

import httpx

from .config import Target
from .errors import CliError

UA = "trainyard-cli/0.1"


def _reason(exc: httpx.HTTPError) -> str:
    text = str(exc) or type(exc).__name__
    low = text.lower()
    if "refused" in low:
        return "connection refused"
    if "name or service not known" in low or "nodename nor servname" in low or "name resolution" in low:
        return "unknown host"
    return text


class Api:
    def __init__(self, target: Target, *, timeout: float = 30.0,
                 transport: httpx.BaseTransport | None = None) -> None:
        self.target = target
        headers = {"User-Agent": UA}
        if target.token:
            headers["Authorization"] = f"Bearer {target.token}"
        self._http = httpx.Client(base_url=target.url, headers=headers, timeout=timeout, transport=transport)
        self._timeout = timeout

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Api:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _send(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        url = self.target.url
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.ConnectError as exc:
            raise CliError(f"cannot reach the gateway at {url}: {_reason(exc)} — is `make run` running?") \
                from None
        except httpx.TimeoutException:
            raise CliError(f"the gateway at {url} did not answer within {self._timeout:g}s") from None
        except httpx.HTTPError as exc:
            raise CliError(f"request to the gateway at {url} failed: {_reason(exc)}") from None
        if response.status_code >= 400:
            raise CliError(self._error_message(response))
        return response

    def _error_message(self, response: httpx.Response) -> str:
        message = ""
        try:
            body = response.json()
            if isinstance(body, dict) and isinstance(body.get("error"), dict):
                message = str(body["error"].get("message", ""))
        except ValueError:
            pass
        if not message:
            message = f"the gateway answered {response.status_code} {response.reason_phrase}"
            snippet = response.text.strip()[:200]
            if snippet:
                message += f": {snippet}"
        if response.status_code == 401:
            source = self.target.token_source or "nowhere"
            message += f" (token from {source})"
        return message

    def _json(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self._send(method, path, **kwargs)
        try:
            return response.json()
        except ValueError:
            raise CliError(f"the gateway answered {method} {path} with something that is not JSON") from None

    # -- jobs ------------------------------------------------------------------------------------
    def submit(self, spec: dict[str, Any], *, idempotency_key: str = "") -> dict[str, Any]:
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        result: dict[str, Any] = self._json("POST", "/v1/jobs", json=spec, headers=headers)
        return result

    def job(self, job_id: str) -> dict[str, Any]:
        result: dict[str, Any] = self._json("GET", f"/v1/jobs/{quote(job_id, safe='')}")
        return result

    def jobs_page(self, *, page_size: int, page_token: str = "",
                  filters: Sequence[tuple[str, str]] = ()) -> dict[str, Any]:
        """One page of GET /v1/jobs; `filters` are its query parameters (state, user, label, ...), repeatable
        ones given once per value."""
        params: list[tuple[str, str | int]] = [("page_size", page_size)]
        if page_token:
            params.append(("page_token", page_token))
        params += list(filters)
        result: dict[str, Any] = self._json("GET", "/v1/jobs", params=params)
        return result

    def cancel(self, job_id: str, reason: str = "") -> dict[str, Any]:
        result: dict[str, Any] = self._json("POST", f"/v1/jobs/{quote(job_id, safe='')}:cancel",
                                            json={"reason": reason} if reason else None)
        return result

    def job_operation(self, job_id: str, operation: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        """POST /v1/jobs/{id}:<operation> (hold, release, requeue)."""
        result: dict[str, Any] = self._json("POST", f"/v1/jobs/{quote(job_id, safe='')}:{operation}", json=body)
        return result

    def set_priority(self, job_id: str, priority: int) -> dict[str, Any]:
        result: dict[str, Any] = self._json("PATCH", f"/v1/jobs/{quote(job_id, safe='')}", json={"priority": priority})
        return result

    def resubmit(self, job_id: str, overrides: dict[str, Any], *, idempotency_key: str = "") -> dict[str, Any]:
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        result: dict[str, Any] = self._json("POST", f"/v1/jobs/{quote(job_id, safe='')}:resubmit",
                                            json={"overrides": overrides}, headers=headers)
        return result

    def logs(self, job_id: str, *, tail: int = 0, attempt: int | None = None) -> str:
        params: dict[str, int] = {"tail": tail}
        if attempt is not None:
            params["attempt"] = attempt
        return self._send("GET", f"/v1/jobs/{quote(job_id, safe='')}/logs", params=params).text

    # -- checkpoints -----------------------------------------------------------------------------
    def _checkpoints(self, job_id: str, rest: str = "") -> str:
        return f"/v1/jobs/{quote(job_id, safe='')}/checkpoints{rest}"

    def checkpoints_page(self, job_id: str, *, page_size: int, page_token: str = "") -> dict[str, Any]:
        params: dict[str, str | int] = {"page_size": page_size, **({"page_token": page_token} if page_token else {})}
        result: dict[str, Any] = self._json("GET", self._checkpoints(job_id), params=params)
        return result

    def checkpoint(self, job_id: str, checkpoint_id: str) -> dict[str, Any]:
        result: dict[str, Any] = self._json("GET", self._checkpoints(job_id, f"/{quote(checkpoint_id, safe='')}"))
        return result

    def checkpoint_manifest(self, job_id: str, checkpoint_id: str) -> dict[str, Any]:
        result: dict[str, Any] = self._json("GET", self._checkpoints(
            job_id, f"/{quote(checkpoint_id, safe='')}/manifest"))
        return result

    def tag_checkpoint(self, job_id: str, checkpoint_id: str, tag: str) -> dict[str, Any]:
        result: dict[str, Any] = self._json("PUT", self._checkpoints(
            job_id, f"/{quote(checkpoint_id, safe='')}/tags/{quote(tag, safe='')}"))
        return result

    def untag_checkpoint(self, job_id: str, checkpoint_id: str, tag: str) -> dict[str, Any]:
        result: dict[str, Any] = self._json("DELETE", self._checkpoints(
            job_id, f"/{quote(checkpoint_id, safe='')}/tags/{quote(tag, safe='')}"))
        return result

    def delete_checkpoint(self, job_id: str, checkpoint_id: str) -> dict[str, Any]:
        result: dict[str, Any] = self._json("DELETE", self._checkpoints(job_id, f"/{quote(checkpoint_id, safe='')}"))
        return result

    # -- nodes and tokens ------------------------------------------------------------------------
    def nodes(self) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self._json("GET", "/v1/nodes")["nodes"]
        return result

    def create_token(self, *, team: str, user: str, role: str, ttl: str | None, scopes: list[str],
                     description: str) -> dict[str, Any]:
        body: dict[str, Any] = {"team": team, "user": user, "role": role, "scopes": scopes,
                                "description": description}
        if ttl:
            body["ttl"] = ttl
        result: dict[str, Any] = self._json("POST", "/v1/tokens", json=body)
        return result

    def tokens(self, team: str = "") -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self._json("GET", "/v1/tokens",
                                                  params={"team": team} if team else None)["tokens"]
        return result

    def revoke_token(self, token_id: str) -> dict[str, Any]:
        result: dict[str, Any] = self._json("DELETE", f"/v1/tokens/{quote(token_id, safe='')}")
        return result

    # -- audit ------------------------------------------------------------------------------------
    def audit(self, params: dict[str, str | int]) -> dict[str, Any]:
        result: dict[str, Any] = self._json("GET", "/v1/audit", params=params)
        return result

    def usage(self, params: dict[str, str | int]) -> dict[str, Any]:
        result: dict[str, Any] = self._json("GET", "/v1/usage", params=params)
        return result

    # -- queues and quotas -----------------------------------------------------------------------
    def queues(self) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self._json("GET", "/v1/queues")["queues"]
        return result

    def put_queue(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        result: dict[str, Any] = self._json("PUT", f"/v1/queues/{quote(name, safe='')}", json=body)
        return result

    def delete_queue(self, name: str) -> dict[str, Any]:
        result: dict[str, Any] = self._json("DELETE", f"/v1/queues/{quote(name, safe='')}")
        return result

    def quotas(self) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self._json("GET", "/v1/quotas")["quotas"]
        return result

    def quota(self, team: str) -> dict[str, Any]:
        result: dict[str, Any] = self._json("GET", f"/v1/quotas/{quote(team, safe='')}")
        return result

    def put_quota(self, team: str, body: dict[str, Any]) -> dict[str, Any]:
        result: dict[str, Any] = self._json("PUT", f"/v1/quotas/{quote(team, safe='')}", json=body)
        return result

    def delete_quota(self, team: str) -> dict[str, Any]:
        result: dict[str, Any] = self._json("DELETE", f"/v1/quotas/{quote(team, safe='')}")
        return result
