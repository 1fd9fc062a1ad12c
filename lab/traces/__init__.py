"""Drafter traces: a real drafter's proposals along the target's greedy output (format), taken
once from the real models (record) or drawn from a stated acceptance (synthetic, calibrated),
then replayed by many emulated devices (replay), a whole fleet of them at once (fleet)."""
from lab.traces.format import Trace, TraceSet
from lab.traces.record import record_traces
from lab.traces.replay import TraceDivergence, TraceDrafter

__all__ = ["Trace", "TraceDivergence", "TraceDrafter", "TraceSet", "record_traces"]
