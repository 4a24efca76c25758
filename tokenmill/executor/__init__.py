"""The executor boundary: how the engine runs its model, in this process or over several ranks."""

from tokenmill.executor.base import Executor, ExecutorDiedError, make_executor

__all__ = ["Executor", "ExecutorDiedError", "make_executor"]
