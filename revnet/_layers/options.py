"""How a reversible stack runs: one frozen value, checked where it is made.

Every front door's ``ReversibleSequence``, and Haiku's ``RevNet`` and
``ReversibleTransformer`` (which build sequences), take the same options of
how their stack runs: ``reversible``, ``anchor_every``, ``drift``,
``decisions``, ``kinks``, ``activation_sharding`` and ``plan``. A module checks them
once, when it is made (:meth:`StackOptions.checked`, whose messages name the
module), holds the one :class:`StackOptions` value and hands it to
:func:`revnet._layers.stack.run_stack`; a model hands its value on to the
sequences it builds. ``decisions`` and ``kinks`` become the engine's one
storage value (:class:`revnet._engine.Storage`), checked as
:func:`revnet.invertible` checks them.

A new stack option is one field of :class:`StackOptions`, its check in
:meth:`StackOptions.checked` and a keyword in the doors' signatures.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from revnet._checks import (
    check_bool,
    check_int,
    check_monitor,
    check_sharding,
    fail,
)
from revnet._engine import Storage
from revnet._layers.budget import Budget
from revnet._layers.plan import StackPlan
from revnet.drift import DriftMonitor


@dataclasses.dataclass(frozen=True)
class StackOptions:
    """The options of a stack of layers, checked.

    Attributes:
      reversible: If False, the layers run in a plain ``lax.scan`` under
        ordinary autodiff (the twin to compare with).
      anchor_every: None, or ``k``: store the stream before every ``k``-th
        layer and restart the backward pass's inversion from each stored one.
      drift: None, or a :class:`revnet.DriftMonitor` receiving each backward
        pass's reconstruction error at the anchors.
      storage: What the forward pass stores (``decisions`` and ``kinks``, as
        in :func:`revnet.invertible`).
      activation_sharding: None, or the ``PartitionSpec`` or
        ``NamedSharding`` each layer's input and output are constrained to
        (see :mod:`revnet._layers.activation_sharding`).
      plan: None, a :class:`revnet.StackPlan` (how many layers store their
        residuals or recompute from their input rather than invert), or a
        :class:`revnet.Budget` the plan is found within by compiling
        (``reversible`` stacks only; see :mod:`revnet._layers.plan` and
        :mod:`revnet._layers.budget`).
    """

    reversible: bool = True
    anchor_every: int | None = None
    drift: DriftMonitor | None = None
    storage: Storage = Storage()
    activation_sharding: Any = None
    plan: StackPlan | Budget | None = None

    @classmethod
    def checked(
        cls,
        module: str,
        *,
        reversible: Any = True,
        anchor_every: Any = None,
        drift: Any = None,
        activation_sharding: Any = None,
        plan: Any = None,
        **storage: Any,
    ) -> StackOptions:
        """The options a module was given, checked in this order.

        Args:
          module: Name of the module, for error messages.
          reversible: As given to the module (see the attributes).
          anchor_every: As given.
          drift: As given.
          activation_sharding: As given.
          plan: As given.
          **storage: The storage options as given (``decisions``, ``kinks``):
            the fields of :class:`revnet._engine.Storage`.

        Returns:
          The options (``reversible`` as a bool, ``anchor_every`` as a
          Python int or None).

        Raises:
          TypeError: If ``reversible`` is not a bool, ``anchor_every`` not an
            integer, ``drift`` not a ``revnet.DriftMonitor`` or
            ``activation_sharding`` not a sharding, or ``plan`` not a
            ``revnet.StackPlan``.
          ValueError: If ``anchor_every`` is not positive, or ``decisions`` or
            ``kinks`` is not one of its choices.
        """
        reversible = check_bool(module, "reversible", reversible)
        if anchor_every is not None:
            anchor_every = check_int(module, "anchor_every", anchor_every)
        drift = check_monitor(module, "drift", drift)
        stored = Storage.checked(module, **storage)
        sharding = check_sharding(module, "activation_sharding", activation_sharding)
        if plan is not None and not isinstance(plan, (StackPlan, Budget)):
            raise fail(
                module,
                "plan",
                plan,
                "None, a revnet.StackPlan(store=..., remat=...) or a "
                "revnet.Budget(bytes)",
            )
        if plan is not None and not reversible:
            raise ValueError(
                f"{module}: a plan chooses per layer among storing, recomputing "
                "and inverting; with reversible=False every layer stores. Give "
                "one or the other."
            )
        return cls(reversible, anchor_every, drift, stored, sharding, plan)

    @property
    def anchors(self) -> bool:
        """Whether anchors are asked for (``anchor_every`` or ``drift``)."""
        return self.anchor_every is not None or self.drift is not None


DEFAULTS = StackOptions()
"""The options of a stack given none."""


class OptionViews:
    """A sequence's ``options``, read under its constructor's argument names
    (``seq.reversible``, ``seq.drift``, ...)."""

    options: StackOptions

    @property
    def reversible(self) -> bool:
        """See :class:`StackOptions`."""
        return self.options.reversible

    @property
    def anchor_every(self) -> int | None:
        """See :class:`StackOptions`."""
        return self.options.anchor_every

    @property
    def drift(self) -> DriftMonitor | None:
        """See :class:`StackOptions`."""
        return self.options.drift

    @property
    def decisions(self) -> str:
        """See :class:`StackOptions`."""
        return self.options.storage.decisions

    @property
    def kinks(self) -> str:
        """See :class:`StackOptions`."""
        return self.options.storage.kinks

    @property
    def activation_sharding(self) -> Any:
        """See :class:`StackOptions`."""
        return self.options.activation_sharding

    @property
    def plan(self) -> StackPlan | Budget | None:
        """See :class:`StackOptions`."""
        return self.options.plan
