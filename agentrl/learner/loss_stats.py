"""The statistics a loss returns beside its value, kept on the device until read.

A learner step makes many losses; reading each statistic as it is made (``.item()``) would make
the host wait for the GPU every micro-batch. These hold device tensors and copy them to the host
on first attribute access, so a step reads them all once, at its end.
"""

from __future__ import annotations

import torch


class _DeviceStats:
    """Diagnostics computed on the device and copied to the host on first read, in one copy.

    A loss call therefore never makes the host wait for the GPU: a learner can queue the
    backward (and the next micro-batches) before it reads any statistic.
    """

    __slots__ = ("_device", "_host")
    _NAMES: tuple[str, ...] = ()

    def __init__(self, values: torch.Tensor) -> None:
        if values.shape != (len(self._NAMES),):
            raise ValueError(f"expected {len(self._NAMES)} values, got shape {tuple(values.shape)}")
        self._device: torch.Tensor | None = values.detach().to(torch.float64)
        self._host: list[float] = []

    def _get(self, i: int) -> float:
        if self._device is not None:
            self._host, self._device = self._device.tolist(), None
        return self._host[i]

    def to_metrics(self, prefix: str) -> dict[str, float]:
        """Namespaced metric keys (``prefix/name``) as python floats."""
        return {f"{prefix}/{n}": float(getattr(self, n)) for n in self._NAMES}

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        assert isinstance(other, _DeviceStats)
        return all(getattr(self, n) == getattr(other, n) for n in self._NAMES)

    __hash__ = None  # type: ignore[assignment]  # mutable cache; equal by value

    def __repr__(self) -> str:
        fields = ", ".join(f"{n}={getattr(self, n)!r}" for n in self._NAMES)
        return f"{type(self).__name__}({fields})"


class LossStats(_DeviceStats):
    """Detached diagnostics of one loss call (python numbers, read from the device on first use).

    ``ratio_*`` are over the units the loss clips: sequences for GSPO and GSPO-token (so both
    report the same figures), tokens for GRPO. They are 1.0 when there is no loss token.
    """

    __slots__ = ()
    _NAMES = (
        "clip_frac_tokens",
        "clip_frac_seqs",
        "ratio_mean",
        "ratio_min",
        "ratio_max",
        "approx_kl",
        "num_tokens",
        "num_seqs",
    )

    @property
    def clip_frac_tokens(self) -> float:
        """Share of loss tokens whose gradient the clip removed.

        That is ``r > 1+ε_high, A > 0`` or ``r < 1-ε_low, A < 0``; for GSPO a clipped sequence
        clips all its tokens.
        """
        return self._get(0)

    @property
    def clip_frac_seqs(self) -> float:
        """Share of non-empty sequences with at least one clipped token."""
        return self._get(1)

    @property
    def ratio_mean(self) -> float:
        """Mean importance ratio over the clipped units."""
        return self._get(2)

    @property
    def ratio_min(self) -> float:
        """Smallest importance ratio."""
        return self._get(3)

    @property
    def ratio_max(self) -> float:
        """Largest importance ratio."""
        return self._get(4)

    @property
    def approx_kl(self) -> float:
        """Token mean of the k3 estimate of KL(old || new): ``r - 1 - log r``, ``r = new/old``."""
        return self._get(5)

    @property
    def num_tokens(self) -> int:
        """Number of loss-masked tokens."""
        return int(self._get(6))

    @property
    def num_seqs(self) -> int:
        """Number of rows with at least one loss token."""
        return int(self._get(7))

    def to_metrics(self, prefix: str = "loss") -> dict[str, float]:
        """Namespaced metric keys, e.g. ``{"loss/clip_frac_tokens": 0.12, ...}``."""
        return super().to_metrics(prefix)


class KLStats(_DeviceStats):
    """Detached diagnostics of :func:`kl_to_reference` (read from the device on first use)."""

    __slots__ = ()
    _NAMES = ("kl_token_mean", "kl_token_max", "num_tokens")

    @property
    def kl_token_mean(self) -> float:
        """Token mean of the k3 estimate (the loss is the sequence mean)."""
        return self._get(0)

    @property
    def kl_token_max(self) -> float:
        """Largest per-token k3 estimate."""
        return self._get(1)

    @property
    def num_tokens(self) -> int:
        """Number of loss-masked tokens."""
        return int(self._get(2))

    def to_metrics(self, prefix: str = "kl") -> dict[str, float]:
        """Namespaced metric keys, e.g. ``{"kl/kl_token_mean": 0.01, ...}``."""
        return super().to_metrics(prefix)
