"""What a sampler hands back: tokens (and logprobs) still on their way from the device."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmserve.engine.request import TokenLogprobs


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A copy to pinned host memory that does not wait (read it after the step's event)."""
    if not t.is_cuda:
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


class SampledLogprobs:
    """Logprobs of the rows that asked, computed on the device for the whole batch at once:
    the sampled token's logprob and rank, and the top max(k) of each row (a row shows its k)."""

    def __init__(self, rows: list[int], ks: list[int], token_lp: torch.Tensor | None = None,
                 rank: torch.Tensor | None = None, top_values: torch.Tensor | None = None,
                 top_ids: torch.Tensor | None = None, ready: list[TokenLogprobs | None] | None = None) -> None:  # fmt: skip
        self.rows, self.ks, self._ready = rows, ks, ready
        self.tensors = None
        if ready is None:
            self.tensors = [_to_host(t) for t in (token_lp, rank, top_values, top_ids)]

    @classmethod
    def ready(cls, per_row: list[TokenLogprobs | None]) -> SampledLogprobs:
        """Already made on the host, one per row (the reference sampler's)."""
        return cls([], [], ready=per_row)

    def result(self, num_rows: int) -> list[TokenLogprobs | None]:
        if self._ready is not None:
            return self._ready
        token_lp, rank, values, ids = (t.tolist() for t in self.tensors)
        out: list[TokenLogprobs | None] = [None] * num_rows
        for j, (row, k) in enumerate(zip(self.rows, self.ks)):
            out[row] = TokenLogprobs(token_lp[j], rank[j], list(zip(ids[j][:k], values[j][:k])))
        return out


class PendingSample:
    """Sampled tokens still on their way from the device."""

    def __init__(self, tokens: torch.Tensor, logprobs: SampledLogprobs | None = None) -> None:
        self.device_tokens = tokens  # read by the next step before the host has them
        self.logprobs = logprobs
        self.host = _to_host(tokens)
        self.event = None
        if tokens.is_cuda:
            self.event = torch.cuda.Event()
            self.event.record()

    def result(self) -> SamplerOutput:
        if self.event is not None:
            self.event.synchronize()
        token_list = self.host.tolist()
        if self.logprobs is None:
            return SamplerOutput(token_list, [None] * len(token_list))
        return SamplerOutput(token_list, self.logprobs.result(len(token_list)))
