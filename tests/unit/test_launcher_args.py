from __future__ import annotations

import pytest

from launch.launcher import main
from launch.server_args import ServerArgs, build_parser


@pytest.mark.parametrize("argv,needle", [
    (["--model-path", "/nonexistent/model"], "does not exist"),
    (["--speculative-algorithm", "FOO"], "available: ['EAGLE', 'EAGLE3', 'NGRAM']"),
    (["--schedule-policy", "random"], "--schedule-policy must be one of"),
    (["--chunked-prefill-size", "0"], "--chunked-prefill-size must be positive"),
])
def test_bad_flags_exit_2_with_one_clear_line(argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_every_flag_is_documented_and_defaults_come_from_the_dataclass():
    parser = build_parser()
    defaults = vars(parser.parse_args([]))
    assert defaults == {k: v for k, v in vars(ServerArgs()).items()}
    for action in parser._actions:
        if action.dest != "help":
            assert action.help, f"--{action.dest} has no help text"
    assert ServerArgs().host == "127.0.0.1"
