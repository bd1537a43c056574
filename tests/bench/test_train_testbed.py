"""How a testbed worker that died without reporting is described: from its stderr."""

from gradsum.bench.train_testbed import _cause


def test_a_cpp_abort_is_described_from_its_terminate_line(tmp_path):
    err = tmp_path / "w1.err"
    err.write_text(
        "[W socket.cpp:207] warning\n"
        "terminate called after throwing an instance of 'gloo::IoException'\n"
        "  what():  Connection closed by peer\n"
        "Fatal Python error: Aborted\n\n"
        "Thread 0x1 (most recent call first):\n"
        '  File "loop.py", line 167 in __call__\n'
    )
    described = _cause(err)
    assert described.startswith("terminate called after throwing an instance of 'gloo::")
    assert "Connection closed by peer" in described and "loop.py" in described


def test_a_python_fatal_error_alone_starts_the_description(tmp_path):
    err = tmp_path / "w0.err"
    err.write_text('noise\nFatal Python error: Segmentation fault\n  File "x.py", line 1\n')
    assert _cause(err).startswith("Fatal Python error: Segmentation fault")
