"""The debugging options: profiling, flight recorder, distributed debug level, anomaly detection."""

from titan.config import parse_args


def test_debugging_is_off_by_default_except_the_flight_recorder():
    cfg = parse_args([])
    assert not cfg.profiling.enable_profiling and not cfg.profiling.enable_memory_snapshot
    assert cfg.debug.distributed_debug == "off" and cfg.debug.detect_anomaly is False
    assert cfg.comm.trace_buf_size == 20000


def test_debugging_options_parse():
    cfg = parse_args(["--profiling.enable_profiling", "--profiling.profile_freq", "5",
                      "--profiling.enable_memory_snapshot", "--debug.distributed_debug", "detail",
                      "--debug.detect_anomaly", "--comm.trace_buf_size", "0"])
    assert cfg.profiling.enable_profiling and cfg.profiling.enable_memory_snapshot
    assert cfg.profiling.profile_freq == 5
    assert cfg.debug.distributed_debug == "detail" and cfg.debug.detect_anomaly
    assert cfg.comm.trace_buf_size == 0
