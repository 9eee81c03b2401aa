"""Sessions whose steps draw random numbers on the client (:mod:`salus.hlo.draws`): the
seeds they keep there, the random numbers each step sends with its batch, and
checkpoints that carry the seeds."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import torch

from ..errors import SalusError
from ..trace import TracedStep


class SeededSession:
    """Mixed into a session (before :class:`salus.torch._SalusSession`): ``_seeds`` holds
    each seed's value by name; :meth:`_drawn` draws a step's random numbers and advances
    them as the step does."""

    _seeds: dict[str, np.ndarray]

    def _keep_seeds(self, seeds: Mapping[str, Any]) -> None:
        self._seeds = {name: np.array(value) for name, value in seeds.items()}

    def _drawn(self, traced: TracedStep) -> list[torch.Tensor]:
        """The random numbers of one step of ``traced``, as feeds; the seeds advance."""
        if traced.draws is None:
            return []
        values, advanced = traced.draws.draw(self._seeds)
        self._seeds.update(advanced)
        return [torch.from_numpy(np.ascontiguousarray(v)) for v in values]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The session's tensors on salusd, and its seeds as they are on the client."""
        values = super().state_dict()  # type: ignore[misc]
        values.update({name: torch.from_numpy(seed.copy()) for name, seed in self._seeds.items()})
        return values

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> None:
        """As the session's own, the seeds taken on the client."""
        rest = dict(state_dict)
        for name, seed in self._seeds.items():
            if name in rest:
                value = np.asarray(rest.pop(name))
                if value.shape != seed.shape:
                    raise SalusError(f"load_state_dict: {name} is {list(value.shape)} but "
                                     f"the session's seed is {list(seed.shape)}")
                self._seeds[name] = value.astype(seed.dtype)
        super().load_state_dict(rest, strict)  # type: ignore[misc]
