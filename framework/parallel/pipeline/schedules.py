"""The schedule registry's old import path, kept for schedule modules written against it
(`schedule.modules`): the registry moved to framework/schedules/ (issue 49, below config).
Its public names resolve to the same objects there; importing this warns once."""

import warnings

import framework.schedules as _registry

__all__ = list(_registry.__all__)  # Action, Op, Schedule, register, ...
globals().update({name: getattr(_registry, name) for name in __all__})

warnings.warn("framework.parallel.pipeline.schedules moved to framework.schedules; import from there",
              DeprecationWarning, stacklevel=2)
