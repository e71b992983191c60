"""Lifting Haiku functions into pure functions of explicit parameters.

Haiku cannot put a JAX transform (such as :func:`revnet.invertible` or
:func:`revnet.inverse`) around module code that creates parameters. The blocks
therefore run each Haiku function through an inner ``hk.transform_with_state``,
register its parameters and state in the enclosing module with
``hk.lift_with_state``, and call the pure ``apply`` with explicit
``(params, state, rng, x)``. The core can then trace, invert and differentiate
that pure function like any other.

:class:`Lifted` must be constructed in a module's ``__init__`` (never in a
helper method: Haiku would then put ``~_method`` into the parameter paths and
write state to one path while reading it from another).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import haiku as hk
import jax
import jax.numpy as jnp

from revnet._layers.precision import cast_floats
from revnet._layers.stack import checked_layer
from revnet.blocks.sharding import replicated_in_auto_axes

PureApply = Callable[[Any, Any, Any, jax.Array], tuple[jax.Array, Any]]


class Lifted:
    """A Haiku function lifted into the module that constructs it.

    Args:
      fn: Function that builds and applies Haiku modules, called as ``fn(x)``.
      owner: The module constructing this object, from its ``__init__``.
      name: Name scope of the lifted parameters (``"f"`` gives paths like
        ``"additive_coupling/~/f/linear"``).
      compute_dtype: If given, floating parameters and the input are cast to this
        dtype before ``fn`` runs, and its output is cast back to the input's
        dtype. Parameters are stored in the dtype they were created in.
      num_stacked: If given, ``num_stacked`` independently initialised copies
        of the parameters and state are stacked on a leading axis (as
        ``hk.layer_stack`` does); ``apply`` then takes one slice.
      zero_last: If True, the parameters of the module that ``fn`` creates
        last (its output layer, for ``hk.nets.MLP``) are initialised to zero.
    """

    def __init__(
        self,
        fn: Callable[..., jax.Array],
        owner: hk.Module,
        name: str,
        compute_dtype: Any = None,
        num_stacked: int | None = None,
        zero_last: bool = False,
    ):
        self.transformed = hk.transform_with_state(fn)
        init = self.transformed.init
        if zero_last:
            init = _zero_last_module(init)
        if num_stacked is not None:
            one = init

            def init(key, x, *args, **kwargs):
                keys = jax.random.split(key, num_stacked)

                def stacked(keys, x, *args):
                    # One layer after another, as hk.layer_stack does: each
                    # layer is initialised from its own input, so that a
                    # data-dependent initialisation (ActNorm) sees it.
                    apply = self._checked_apply(args, kwargs)

                    def step(h, k):
                        params, state = one(k, h, *args, **kwargs)
                        y, _ = apply(params, state, k, h)
                        return y, (params, state)

                    return jax.lax.scan(step, x, keys)[1]

                return replicated_in_auto_axes(stacked)(keys, x, *args)

        self._params_and_state, updater = hk.lift_with_state(
            init, name=name, allow_reuse=True
        )
        # The updater returned above is bound to this call; each application
        # creates its own (see `update_state`), so that a module can be called
        # more than once per transform.
        updater.ignore_update()
        self._path = f"{owner.module_name}/~/{name}"
        self._owner = owner.module_name
        self.compute_dtype = compute_dtype

    def params_and_state(self, *args: Any, **kwargs: Any) -> tuple[hk.Params, hk.State]:
        """Creates (init) or fetches (apply) the lifted parameters and state."""
        return self._fetch(*args, **kwargs)[1:]

    def _fetch(self, *args: Any, **kwargs: Any) -> tuple[Any, hk.Params, hk.State]:
        key = hk.next_rng_key() if hk.running_init() else None
        return (key, *self._params_and_state(key, *args, **kwargs))

    def initialised(
        self, x: Any, *args: Any, **kwargs: Any
    ) -> tuple[hk.Params, hk.State, Any]:
        """``(params, state, y)``: :meth:`params_and_state`, and at init the
        output ``y`` of the function at ``x`` (None when applying), so that
        a list of blocks initialises each one from its own input."""
        key, params, state = self._fetch(x, *args, **kwargs)
        if key is None:
            return params, state, None
        apply = self._checked_apply(args, kwargs)
        y, _ = apply(params, state, jax.random.fold_in(key, 1), x)
        return params, state, y

    def _checked_apply(self, args: tuple, kwargs: dict) -> PureApply:
        """The pure function with the block's extra arguments, checking that
        it preserves its input's shape and dtype (as the stack does)."""
        apply = make_pure(
            lambda p, s, k, h: self.transformed.apply(p, s, k, h, *args, **kwargs),
            self.compute_dtype,
        )
        return checked_layer(apply, self._owner, reversible=False)

    def update_state(self, state: hk.State) -> None:
        """Writes the new inner state into the enclosing transform."""
        if state:
            hk.LiftWithStateUpdater(self._path).update(state)

    @property
    def apply(self) -> PureApply:
        """The pure function ``(params, state, rng, x) -> (y, new_state)``."""
        return make_pure(self.transformed.apply, self.compute_dtype)


def _zero_last_module(init: Callable[..., Any]) -> Callable[..., Any]:
    """``init`` whose last-created module's parameters are zeros.

    Haiku's parameter dictionaries keep the order in which modules were
    created, so the last entry is the module created last.
    """

    def zeroed(*args: Any, **kwargs: Any) -> tuple[hk.Params, hk.State]:
        params, state = init(*args, **kwargs)
        if params:
            params = dict(params)
            last = next(reversed(params))
            params[last] = jax.tree.map(jnp.zeros_like, params[last])
        return params, state

    return zeroed


def make_pure(apply_fn: PureApply, compute_dtype: Any) -> PureApply:
    """Wraps ``apply_fn`` in a dtype policy: compute in ``compute_dtype``."""
    if compute_dtype is None:
        return apply_fn

    def pure(params, state, rng, x):
        out, new_state = apply_fn(
            cast_floats(params, compute_dtype), state, rng, x.astype(compute_dtype)
        )
        return out.astype(x.dtype), new_state

    return pure
