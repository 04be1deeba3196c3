"""A ``DecodeSession`` that fails on purpose, for fault-isolation tests."""

from collections.abc import Callable, Hashable, Sequence

from speculative.session import DecodeSession

Never = lambda *_: False  # noqa: E731


class FaultySession(DecodeSession):
    """Fails a prefill when ``fail_prefill(keys, prompts)`` holds and a round
    when ``fail_round(keys)`` holds; a round fails after its target forward
    appended to the cache and the generators drew (the worst place: the state
    must roll back). Parts split off keep the same faults."""

    def __init__(
        self,
        *args,
        fail_prefill: Callable[[list, list], bool] = Never,
        fail_round: Callable[[list], bool] = Never,
        **kwargs,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.fail_prefill, self.fail_round = fail_prefill, fail_round

    def add(self, keys: Sequence[Hashable], prompts, sampling):
        if self.fail_prefill(list(keys), [list(p) for p in prompts]):
            raise RuntimeError("injected prefill fault")
        return super().add(keys, prompts, sampling)

    def split(self, keys: Sequence[Hashable]) -> DecodeSession:
        part = super().split(keys)
        part.fail_prefill, part.fail_round = self.fail_prefill, self.fail_round
        return part

    def _accept(self, *args):
        verdict = super()._accept(*args)
        if self.fail_round(list(self.rows.keys)):
            raise RuntimeError("injected round fault")
        return verdict
