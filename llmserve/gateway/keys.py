"""API keys: looked up by their sha256, never stored in the clear."""

from __future__ import annotations

import hmac

from llmserve.gateway.config import ApiKey, hash_key


class KeyStore:
    def __init__(self, keys: list[ApiKey]):
        self._by_hash = {k.sha256: k for k in keys}
        self.open = not keys  # no keys configured: every request is let in

    def authenticate(self, authorization: str | None) -> ApiKey | None:
        """The key behind an `Authorization: Bearer ...` header, or None when missing, wrong or revoked."""
        if not authorization or not authorization.startswith("Bearer "):
            return None
        digest = hash_key(authorization[len("Bearer ") :].strip())
        key = self._by_hash.get(digest)
        # the dict lookup already matched; compare_digest keeps the final check constant-time
        if key is None or key.revoked or not hmac.compare_digest(key.sha256, digest):
            return None
        return key


def may_call(key: ApiKey, alias: str) -> bool:
    return "*" in key.models or alias in key.models
