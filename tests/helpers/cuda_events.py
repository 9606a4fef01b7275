"""A stand-in for ``torch.cuda.Event(enable_timing=True)`` on a CPU machine: a model of one CUDA stream and its
timing events, for the tests of compute timed on the device (``runtime/execution/accounts.py``)."""

from __future__ import annotations


class StandInDevice:
    """One CUDA stream and its timing events, as the accounts see them. Each pair of records brackets one compute
    action, which the device runs for the next of ``durations`` (ms); an event's time may be read only after a
    ``synchronize`` of it or of a later event (CUDA raises "not ready" otherwise); an event recorded again before its
    time was read would lose it."""

    def __init__(self, durations: list[float]) -> None:
        self.durations = list(durations)
        self.ran: list[float] = []  # the durations the device ran, in order
        self.now = 0.0
        self.seq = 0  # records so far: an event's place on the stream
        self.done = 0  # the last place a synchronize waited for
        self.inside = False  # between the records of a pair
        self.made = self.records = self.syncs = 0

    def event(self, enable_timing: bool = False) -> StandInEvent:
        assert enable_timing, "a CUDA event times nothing without enable_timing=True"
        self.made += 1
        return StandInEvent(self)

    def timing_event(self) -> StandInEvent:
        """A factory for ``StepAccounts(events=...)``: what ``cuda_event`` makes."""
        return self.event(enable_timing=True)


class StandInEvent:
    def __init__(self, device: StandInDevice) -> None:
        self.device = device
        self.at = 0.0
        self.seq = 0
        self.read = True  # nothing recorded yet: free to record

    def record(self) -> None:
        d = self.device
        assert self.read, "an event recorded again before its time was read"
        d.records += 1
        d.seq += 1
        if d.inside:  # the end of a pair: the action's kernels ran
            d.ran.append(d.durations[len(d.ran)])
            d.now += d.ran[-1]
        d.inside = not d.inside
        self.at, self.seq, self.read = d.now, d.seq, False

    def synchronize(self) -> None:
        self.device.syncs += 1
        self.device.done = max(self.device.done, self.seq)

    def elapsed_time(self, end: StandInEvent) -> float:
        if max(self.seq, end.seq) > self.device.done:
            raise RuntimeError("CUDA error: device not ready")
        self.read = end.read = True
        return end.at - self.at
