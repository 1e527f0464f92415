"""The kernels' build: keyed by the sources, announced before and timed after, cached."""

import logging

from dspark.kernels import build


def test_a_build_is_announced_timed_and_then_reused(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    commands = []

    def compile_and_link(batch):                 # stands in for the compiler: writes each output
        commands.append(batch)
        for command in batch:
            open(command[command.index("-o") + 1], "wb").close()

    monkeypatch.setattr(build, "_run_all", compile_and_link)
    with caplog.at_level(logging.INFO, logger=build.__name__):
        lib = build.build("c++")
    assert lib.exists() and lib.parent == tmp_path / "dspark" / "kernels"
    assert len(commands[0]) == len(build.sources()) and len(commands[1]) == 1     # side by side, one link
    notices = [r.getMessage() for r in caplog.records if r.name == build.__name__]
    assert len(notices) == 2
    assert notices[0].startswith(f"compiling dspark's CPU kernels into {lib.parent} (once per machine; about ")
    assert notices[1].startswith("compiled dspark's CPU kernels in ")
    caplog.clear()
    assert build.build("c++") == lib and len(commands) == 2 and not caplog.records   # cached: silent


def test_the_build_notices_pass_a_warnings_only_logging_setup():
    """The command line shows warnings only unless asked for more; a first build still says so."""
    assert build.logger.getEffectiveLevel() == logging.INFO


def test_the_library_name_follows_every_source(tmp_path, monkeypatch):
    monkeypatch.setattr(build, "CSRC", tmp_path)
    (tmp_path / "a.cpp").write_text("int a;")
    (tmp_path / "k.h").write_text("#pragma once")
    first = build.library_path("c++")
    (tmp_path / "b.cpp").write_text("int b;")
    second = build.library_path("c++")
    (tmp_path / "k.h").write_text("#pragma once // changed")
    assert len({first, second, build.library_path("c++"), build.library_path("g++")}) == 4
