"""The stop paths: a signal, a cloud's preemption notice, a dead launcher; each sets the one stop flag
(`preemption`), and every rank stops at the same step."""
