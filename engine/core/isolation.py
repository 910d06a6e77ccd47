"""FaultIsolation: which request makes steps fail, found by running steps with fewer suspects.

A step that raises leaves no request behind: the engine resets every request to recompute from
its tokens, and the requests then unfinished become suspects, those the step ran first. Steps
go on with a window of suspects allowed to run (the first `window` of the list); a suspect is
cleared once a step samples for it without failing, or it finishes. A failure narrows the
window to half the suspects it ran; a failure that ran one suspect names it, and it alone is
failed. When the first half of a failed step's suspects passes, the other half runs next
(a binary search: O(log n) failed steps); with the culprit gone the window doubles with each
step that clears suspects. Requests that arrive meanwhile wait until the list is empty, so
nothing new joins a step being searched.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence

from kvfleet.engine.core.request import RequestId

# A healthy engine fails steps for bad requests, not for every request: this many requests
# named in a row without a step passing between them means the engine itself is broken.
MAX_CULPRITS_IN_A_ROW = 4


class EngineSickError(RuntimeError):
    """Steps fail whatever runs in them: the engine, not a request, is at fault."""


class FaultIsolation:
    def __init__(self) -> None:
        self.suspects: list[RequestId] = []
        self.window = 0  # the first `window` suspects may run
        self.group = 0  # the first `group` suspects hold the culprit (0: not known)
        self.culprits_in_a_row = 0

    @property
    def active(self) -> bool:
        return bool(self.suspects)

    def may_start(self, request_id: RequestId) -> bool:
        """Whether a waiting request may be scheduled now."""
        return not self.suspects or request_id in self.suspects[: self.window]

    def step_failed(
        self,
        unfinished: Sequence[RequestId],
        in_step: Collection[RequestId],
        scheduling: RequestId | None = None,
    ) -> RequestId | None:
        """A step raised. `unfinished`: every unfinished request, in queue order; `in_step`:
        those the step ran; `scheduling`: the request the scheduler was at, if it raised.
        Returns the request the failure is blamed on, if it is known now (no longer a
        suspect)."""
        if scheduling is not None:
            in_step = {*in_step, scheduling}
        ran = [r for r in self.suspects if r in in_step]
        if not ran:  # a new search (or cleared requests failed: they are suspects again)
            ran = [r for r in unfinished if r in in_step]
            if scheduling is not None:  # most likely its own: it runs alone first
                ran = [scheduling, *(r for r in ran if r != scheduling)]
            self.suspects = ran + [r for r in unfinished if r not in in_step]
            self.group = len(ran)
            # (one request alone runs once more before it is blamed)
            self.window = 1 if scheduling is not None else max(1, -(-len(ran) // 2))
            return None
        self.suspects = ran + [r for r in self.suspects if r not in in_step]
        if len(ran) > 1:
            self.group, self.window = len(ran), -(-len(ran) // 2)
            return None
        culprit = self.suspects.pop(0)
        self.group, self.window = 0, 1
        self.culprits_in_a_row += 1
        if self.culprits_in_a_row >= MAX_CULPRITS_IN_A_ROW:
            raise EngineSickError(
                f"{self.culprits_in_a_row} requests in a row failed their steps alone"
            )
        return culprit

    def step_passed(self, sampled: Iterable[RequestId]) -> None:
        """A step completed; `sampled`: the requests it produced a token for."""
        self.culprits_in_a_row = 0
        if self.suspects:
            cleared = set(sampled)
            self._clear([r for r in self.suspects if r in cleared])

    def forget(self, request_ids: Iterable[RequestId]) -> None:
        """Requests that finished (or were aborted) are no longer suspects."""
        if self.suspects:
            gone = set(request_ids)
            self._clear([r for r in self.suspects if r in gone])

    def _clear(self, innocent: list[RequestId]) -> None:
        if not innocent:
            return
        in_window = sum(1 for r in self.suspects[: self.window] if r in innocent)
        in_group = sum(1 for r in self.suspects[: self.group] if r in innocent)
        self.suspects = [r for r in self.suspects if r not in innocent]
        self.group -= in_group
        if self.window - in_window > 0:
            self.window -= in_window  # the rest of the window is still to run
        elif self.group > 0:
            self.window = self.group  # the first half was innocent: the other half
        else:
            self.window = min(2 * self.window, max(1, len(self.suspects)))
