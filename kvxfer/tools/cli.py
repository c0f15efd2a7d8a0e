"""The ``kvxfer`` command line: one subcommand per job, each in its own module, imported on use.

The jobs that run engines or child processes (``demo``, ``stress``, ``bench``, ``serve-toy``, ``fleet``) stop
cleanly on SIGTERM, SIGINT (Ctrl-C) and SIGHUP: children stopped, temporary files removed, one line
on stderr naming the job and the signal, exit status 128 + the signal's number
(:func:`kvxfer.tools.procs.run_stoppable`).

``demo``, ``stress`` and ``bench`` take their transport and its options from
:meth:`kvxfer.EngineConfig.from_env` (``KVXFER_TRANSPORT``, ``KVXFER_IB_DEVICE``,
``KVXFER_GID_INDEX``, ...); a flag given on the command line wins. The transports offered are
:func:`kvxfer.transport.registry.names`.

Mistakes are refused before any work starts, the same way in every subcommand: one line on stderr,
``kvxfer <command>: <reason>``, naming the flag, and exit status 2. Bad values stop the parse
(:class:`_Parser`, with the types of :mod:`kvxfer.tools.checks`); what needs several flags or the
machine (output directories, ports, memory for the pools, a transport's libraries, optional imports)
is checked by the subcommand's ``check`` before its body runs, raising
:class:`~kvxfer.errors.ConfigError`, which :func:`main` prints as that one line. An error during the
work is one line too (exit status 1). ``kvxfer --debug <command> ...`` (or ``KVXFER_DEBUG=1``)
prints the traceback as well.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from .checks import integer, number, output_path, port, size

# EngineConfig.from_env requires max_context; these commands size each engine themselves and take
# only the transport settings from it.
_ANY_CONTEXT = 1


class _HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the text already says it or there is none
    to show (a flag that is off, an option that is unset unless given)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (not action.option_strings or "%(default)" in text or "default" in text.lower()
                or default is None or default is False or default is argparse.SUPPRESS or default == []):
            return text
        return f"{text} (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    """``kvxfer``'s parsers and subparsers: every option's help shows its default, and a mistake is one
    line, ``kvxfer <command>: argument --flag: <why>``, exit status 2 (argparse's usage lines left out:
    ``--help`` shows them)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> Any:  # argparse's signature: NoReturn
        self.exit(2, f"{self.prog}: {' '.join(message.split())}\n")


class _Version(argparse.Action):
    """``--version``: the version and the data path in use (imported only when asked)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        parser._print_message("\n".join(version_lines()) + "\n", sys.stdout)
        parser.exit(0)


def version_lines() -> list[str]:
    """``kvxfer --version``: the version, then which data path runs (native C, and whether it checksums
    with zlib-ng from C; or the pure-Python fallback, why, and what to install)."""
    from ..core import native

    return [f"kvxfer {_version()}", *native.report()]


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(json_path=args.json, verbose=args.verbose, metrics_port=args.metrics_port,
                    linger=args.linger, **args.engine)


def _check_demo(args: argparse.Namespace) -> None:
    """The metrics ports (decode on P, prefill on P + 1) free, and the library that serves them."""
    if args.metrics_port is None:
        return
    from .checks import importable, port_free

    importable("--metrics-port", "prometheus_client", "pip install prometheus-client")
    for offset, role in ((0, "the decode's"), (1, "the prefill's, P + 1")):
        port_free("--metrics-port", "127.0.0.1", args.metrics_port + offset, role=role)


UNSAFE_LEGACY_FAULT = ("oversized", 0.2)  # --unsafe-legacy alone: the incident's fault, near-certain to leak soon


def _check_stress(args: argparse.Namespace) -> None:
    """Build the run's StressConfig (ConfigError naming the flag), then what the machine must offer:
    root, ip and tc for --two-hosts, matplotlib for --report, memory for the pools."""
    from ..errors import ConfigError
    from .stress import ALL_FAULTS

    faults = {name: args.all_faults for name in ALL_FAULTS} if args.all_faults else {}
    for item in args.fault or []:
        name, sep, rate = item.partition("=")
        name = name.strip().replace("-", "_")
        if name not in ALL_FAULTS:
            raise ConfigError(f"--fault {item}: unknown fault {name!r} (known: {', '.join(ALL_FAULTS)})")
        if not sep:
            raise ConfigError(f"--fault {item}: give NAME=RATE, e.g. {name}=0.05")
        value = _number(rate, f"--fault {item}", "a rate")
        if not 0.0 <= value <= 1.0:
            raise ConfigError(f"--fault {item}: the rate must be 0..1")
        faults[name] = value
    args.injected = ""
    if args.unsafe_legacy and not args.fault and not args.all_faults:
        name, rate = UNSAFE_LEGACY_FAULT
        faults[name] = rate
        args.injected = (f"--unsafe-legacy without --fault: injecting the incident's fault, {name} at rate {rate:g} "
                         "(prompts longer than the prefill pool, within the advertised context)")
    net_faults = _net_faults(args.net_fault or [])
    config = _stress_config(args, faults, net_faults)
    if args.injected and config.unsafe_band is None:
        raise ConfigError(f"--unsafe-legacy: the incident's fault ({UNSAFE_LEGACY_FAULT[0]}) needs a prefill pool "
                          f"smaller than the advertised context, and --prefill-pages {config.prefill_pages} hold "
                          f"{config.prefill_tokens:,} tokens of a {config.max_context:,}-token context: lower "
                          "--prefill-pages or give the faults to inject with --fault")
    if config.two_hosts and not config.peer_agent:  # checked before any work: root, ip, tc, a namespace with a veth and a filter
        from .netns import available

        ok, why = available()
        if not ok:
            raise ConfigError(f"--two-hosts: {why}")
    if args.report:
        from .checks import importable

        importable("--report", "matplotlib", "pip install 'kvxfer[report]'")
    from .checks import memory_for

    memory_for(_stress_pool_flags(config), _stress_pools(config))
    args.stress_config = config


def _stress_pool_flags(config: Any) -> str:
    """The flags that size a stress run's pools, with their values."""
    if config.topology:
        sizes = f"--kv-heads {config.kv_heads} x --head-bytes {config.head_bytes}"
    else:
        sizes = f"--item-len {config.item_len}"
    return (f"{sizes} x --layers {config.layers} x 2 buffers, --prefill-pages {config.prefill_pages} and "
            f"--decode-pages {config.decode_pages}")


def _stress_pools(config: Any) -> list[tuple[str, int]]:
    """(what, bytes) of every pool a stress run allocates at once: one per process."""
    pools = []
    for role, pages, page_size, tp, processes in (
            ("prefill", config.prefill_pages, config.prefill_page, config.prefill_tp, config.prefills),
            ("decode", config.decode_pages, config.decode_page, config.decode_tp, config.decodes)):
        for rank in range(tp):
            if config.topology:
                from .stress.ranks import rank_geometry

                item = rank_geometry(config, role, rank).buffers[0].item_len(page_size)
            else:
                item = config.item_len
            count = processes + (config.max_joins if config.churn else 0)
            name = f"{role} pool" + (f" of rank {rank}" if tp > 1 else "") + (f" (x{count} processes)" if count > 1 else "")
            pools.append((name, pages * config.buffers * item * count))
    return pools


def _stress(args: argparse.Namespace) -> int:
    from .netns import NetnsError
    from .stress import run_stress

    if args.injected:
        print(args.injected, flush=True)
    try:
        return run_stress(args.stress_config, json_path=args.json, report_path=args.report,
                          progress=False if args.no_progress else None)
    except NetnsError as exc:  # the machine refused a namespace or a fault after the check passed
        print(f"kvxfer stress: --two-hosts: {exc}", file=sys.stderr)
        return 1


def _number(text: str, flag: str, what: str) -> float:
    """``text`` as a float, or ConfigError naming the flag."""
    from ..errors import ConfigError

    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"{flag}: {text!r} is not {what}") from None


def _net_faults(items: list[str]) -> list[tuple[str, float]]:
    """``--net-fault NAME[=SECONDS]`` items as ``(name, seconds)`` (names checked by StressConfig)."""
    from .stress.workload import DEFAULT_NET_FAULT_SECONDS

    out = []
    for item in items:
        name, sep, seconds = item.partition("=")
        value = _number(seconds, f"--net-fault {item}", "a number of seconds") if sep else DEFAULT_NET_FAULT_SECONDS
        out.append((name.strip().replace("-", "_"), value))
    return out


def _stress_config(args: argparse.Namespace, faults: dict[str, float],
                   net_faults: list[tuple[str, float]] | None = None) -> Any:
    from .stress import StressConfig

    return StressConfig(
        **args.engine,
        requests=args.requests if args.requests is not None or args.duration is not None else 200,
        duration=args.duration, concurrency=args.concurrency,
        median_tokens=args.median_tokens, sigma=args.sigma, page_size=args.page_size, layers=args.layers,
        item_len=args.item_len, prefill_pages=args.prefill_pages, decode_pages=args.decode_pages,
        context=args.context, alloc_policy=args.alloc_policy, free_policy=args.free_policy, seed=args.seed,
        max_chunks=args.max_chunks, unsafe_legacy=args.unsafe_legacy, faults=faults,
        prefill_tp=args.prefill_tp, decode_tp=args.decode_tp, kv_heads=args.kv_heads, head_bytes=args.head_bytes,
        prefill_page_size=args.prefill_page_size, decode_page_size=args.decode_page_size,
        prefills=args.prefills, decodes=args.decodes, churn=args.churn, max_joins=args.max_joins,
        layerwise=args.layerwise, two_hosts=args.two_hosts, peer_agent=args.peer_agent or "", net_faults=net_faults or [],
        net_fault_gap=args.net_fault_gap, net_fault_rounds=args.net_fault_rounds,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kvxfer",
        description="KV-cache transfer engine for disaggregated LLM serving: tagged one-sided writes, "
        "admission that rejects, verified completion, deferred release.",
    )
    parser.add_argument("--version", action=_Version,
                        help="show the version and the data path in use (native C or the pure-Python fallback, "
                        "and why), then exit")
    parser.add_argument("--debug", dest="show_traceback", action="store_true",
                        help="on an error, show the traceback as well as the one-line reason (also KVXFER_DEBUG=1)")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run the scripted prefill/decode session on loopback (the main job)")
    demo.add_argument("--json", metavar="PATH", type=output_path,
                      help="also write the outcomes as JSON (default: not written)")
    _transport_flags(demo)
    demo.add_argument("--verbose", "-v", action="store_true", help="show the engines' logs")
    demo.add_argument("--metrics-port", type=integer(1, 65534, "a TCP port; P + 1 is used too"), default=None,
                      metavar="P",
                      help="serve Prometheus metrics: decode on P, prefill on P+1 (default: not served)")
    demo.add_argument("--linger", type=number(0), default=0.0, metavar="S",
                      help="keep the engines and their metrics endpoints up S seconds after the session")
    demo.set_defaults(func=_demo, check=_check_demo)

    stress = sub.add_parser("stress", help="transfer stress and chaos run judged by a content oracle")
    _transport_flags(stress)
    stress.add_argument("--requests", type=integer(1), default=None,
                        help="requests to run (default 200 without --duration)")
    stress.add_argument("--duration", type=number(above=0), default=None, metavar="S",
                        help="stop starting requests after S seconds (default: no time limit; with --requests, "
                        "whichever comes first)")
    stress.add_argument("--concurrency", type=integer(1), default=16, help="requests in flight at once")
    stress.add_argument("--median-tokens", type=integer(1), default=1500,
                        help="median of the log-normal prompt length")
    stress.add_argument("--sigma", type=number(0), default=1.0, help="log-normal sigma of the prompt length")
    stress.add_argument("--page-size", type=integer(1), default=16, help="tokens per page")
    stress.add_argument("--layers", type=integer(1), default=2, help="layers (two buffers each: K and V)")
    stress.add_argument("--layerwise", action="store_true",
                        help="send each chunk layer by layer (one send per layer and step, the layers of a request "
                        "interleaved at random, each layer's chunks in order), so aborts, kills and link faults "
                        "land between layers (default: whole chunks)")
    stress.add_argument("--item-len", type=integer(32), default=1024,
                        help="bytes per page per buffer (one rank each side; with a topology: page size x the "
                        "rank's heads x --head-bytes)")
    topology = stress.add_argument_group(
        "topology", "prefill and decode servers of several tensor-parallel ranks, each rank its own process, "
        "pages checked head by head; one rank each side with equal page sizes is the plain pair")
    topology.add_argument("--prefill-tp", type=int, default=1, choices=[1, 2, 4],
                          help="prefill ranks: the prefill server's tensor parallelism")
    topology.add_argument("--decode-tp", type=int, default=1, choices=[1, 2, 4],
                          help="decode ranks: the decode server's tensor parallelism")
    topology.add_argument("--kv-heads", type=integer(1, 256), default=4,
                          help="KV heads in all, split between the ranks of each side (a multiple of each TP, "
                          "or a divisor: then heads are replicated)")
    topology.add_argument("--head-bytes", type=integer(32), default=64,
                          help="bytes per head per token (a multiple of 8, at least 32: each cell carries "
                          "the oracle's header)")
    topology.add_argument("--prefill-page-size", type=integer(1), default=None, metavar="TOKENS",
                          help="tokens per prefill page (default: --page-size)")
    topology.add_argument("--decode-page-size", type=integer(1), default=None, metavar="TOKENS",
                          help="tokens per decode page, a multiple or divisor of the prefill's (default: --page-size)")
    fleet = stress.add_argument_group(
        "fleet", "N prefill and M decode processes of one rank each, every decode peered with every prefill, each "
        "request to a random pair; processes killed and restarted, joining and leaving while requests run")
    fleet.add_argument("--prefills", type=integer(1, 16), default=1, metavar="N", help="prefill processes")
    fleet.add_argument("--decodes", type=integer(1, 16), default=1, metavar="M", help="decode processes")
    fleet.add_argument("--churn", type=number(0, 1), default=0.0, metavar="RATE",
                       help="per request started, the chance (0..1) that a random process is SIGKILLed and restarted, "
                       "one more joins or one leaves cleanly")
    fleet.add_argument("--max-joins", type=integer(0, 16), default=2, metavar="K",
                       help="with churn, at most K processes per role above --prefills / --decodes")
    hosts = stress.add_argument_group(
        "two hosts", "the fleet's prefill processes in one network namespace (host a), its decodes in another "
        "(host b), joined by a veth with addresses in 198.18.0.0/15, over tcp with keyrings; network faults while "
        "requests run. Needs root, ip and tc; the namespaces are removed afterwards (kvxfer/tools/netns.py)")
    hosts.add_argument("--two-hosts", action="store_true", help="run the prefills and the decodes on two hosts")
    hosts.add_argument("--peer-agent", metavar="HOST:PORT",
                       help="with --two-hosts: host b is another machine, whose agent (python -m kvxfer.tools.remote "
                       "serve, same KVXFER_REMOTE_TOKEN) listens at HOST:PORT on a link the faults leave alone; host "
                       "a is this one (the soft-RoCE pair: verbs across a wire, tools/softroce/pair --mgmt)")
    hosts.add_argument("--net-fault", action="append", metavar="NAME[=SECONDS]",
                       help="a fault of the timeline, applied for SECONDS (default 2; a kill: the time before the next "
                       "fault), the faults in turn with --net-fault-gap seconds of healthy network before each, "
                       "--net-fault-rounds times, while requests still start: give a --duration (or --requests) that "
                       "covers the timeline, or the report names the faults that never fired (repeatable; default: "
                       "none); names: " + ", ".join(_net_fault_names()))
    hosts.add_argument("--net-fault-gap", type=float, default=0.5, metavar="S",
                       help="seconds of healthy network before each net fault")
    hosts.add_argument("--net-fault-rounds", type=int, default=1, metavar="N",
                       help="times the net faults are played in turn, 0 for as long as requests start (a wire cut "
                       "again and again faster than TCP's backoff recovers stalls every request)")
    stress.add_argument("--prefill-pages", type=integer(1), default=2048, help="pages in the prefill (writer) pool")
    stress.add_argument("--decode-pages", type=integer(1), default=8192, help="pages in the decode (reader) pool")
    stress.add_argument("--context", type=integer(1), default=None, help="advertised context (default: decode pool)")
    stress.add_argument("--alloc-policy", default="lifo", choices=["lifo", "fifo", "random"],
                        help="which free pages the pools hand out first")
    stress.add_argument("--free-policy", default="keep", choices=["keep", "zero", "poison"],
                        help="what a freed page holds: its old bytes, zeros or a poison pattern")
    stress.add_argument("--max-chunks", type=integer(1), default=4, help="chunks per request, chosen 1..N")
    stress.add_argument("--seed", type=integer(), default=0, help="seed of the workload, its faults and page contents")
    stress.add_argument("--all-faults", type=number(0, 1), default=0.0, metavar="RATE",
                        help="enable every fault type at RATE (0..1)")
    stress.add_argument("--fault", action="append", metavar="NAME=RATE",
                        help="set one fault's rate (repeatable; default: none); names: " + ", ".join(_fault_names()))
    stress.add_argument("--unsafe-legacy", action="store_true",
                        help="negative control: the incident's behaviour (no rejection, no verification, "
                        "immediate free); the oracle must report leaks. Without --fault or --all-faults it injects "
                        f"the incident's fault, {UNSAFE_LEGACY_FAULT[0]}={UNSAFE_LEGACY_FAULT[1]:g} (prompts longer "
                        "than the prefill pool), so that it leaks within a few dozen requests; a run in which no "
                        "fault fired is INCONCLUSIVE (exit 1), never a PASS")
    stress.add_argument("--json", metavar="PATH", type=output_path, help="write the summary as JSON (default: not written)")
    stress.add_argument("--report", metavar="PATH.png", type=output_path,
                        help="draw throughput over time and latencies (default: not drawn)")
    stress.add_argument("--no-progress", action="store_true",
                        help="no live progress bar (default: a bar when stdout is a terminal)")
    stress.set_defaults(func=_stress, check=_check_stress)

    bench = sub.add_parser("bench", help="throughput against raw sockets / ib_write_bw and the peers, as ratios")
    _transport_flags(bench)
    bench.add_argument("--total", type=size,
                       help="bytes per case (default 1G on tcp and shm, 64M on verbs); K/M/G suffixes")
    bench.add_argument("--total-small", type=size, help="bytes for pages under 16 KiB (default: --total)")
    bench.add_argument("--page-bytes", action="append", type=size,
                       help="page size, K/M suffixes (repeatable; default 64K and 4K)")
    bench.add_argument("--request-bytes", type=size, default="64M", help="bytes per request (default 64M)")
    bench.add_argument("--concurrency", type=integer(1), default=4, help="requests in flight (default 4)")
    bench.add_argument("--repeat", type=integer(1), default=5, help="repetitions per case; the median is reported")
    bench.add_argument("--checks", default="both", choices=["on", "off", "both"],
                       help="kvxfer with its checksums on, off, or both as two cases")
    bench.add_argument("--baselines", help="comma list: raw-socket,native-stream,mooncake-tcp,nixl-ucx-tcp,ib_write_bw,"
                       "scattered-memcpy,two-copy-memcpy (default: those that apply to the transport), or none")
    bench.add_argument("--compare-windows", action="store_true",
                       help="verbs: run kvxfer with memory windows on and off (each against ib_write_bw)")
    bench.add_argument("--tp", metavar="P:1", default=None,
                       help="also move the same bytes with prefill TP P (2, 4 or 8) into decode TP 1: P prefill "
                       "processes each writing its heads' slice of every decode page (NHD, 8 KV heads), reported "
                       "against the equal-TP case as a ratio (default: not run)")
    bench.add_argument("--first-request", action="store_true",
                       help="instead of throughput: the first request to fresh decodes, cold (peering on demand) "
                       "and peered ahead, against steady state and the handshake itself, on every transport "
                       "this machine runs unless --transport names one (checks on unless --checks off; "
                       "page default 64K)")
    bench.add_argument("--small-requests", nargs="?", const="1,8,64", default=None, metavar="N,N,...",
                       help="instead of throughput: per-request latency of requests of N pages (default 1,8,64), "
                       "one in flight, beside NIXL and Mooncake where installed (checks on; pages of "
                       "--page-bytes, default 4K and 64K)")
    bench.add_argument("--requests", type=integer(1), default=200, help="--small-requests: requests per round and size")
    bench.add_argument("--busy-caller", type=number(0, 1000), default=0.0, metavar="MS",
                       help="--small-requests: the prefill's caller keeps the interpreter busy for MS milliseconds "
                       "after each send(), as a serving engine's scheduler goes on with Python work (default 0)")
    bench.add_argument("--pin", action="store_true",
                       help="run the prefill side's processes (kvxfer's prefill, a peer's initiator) on the first half "
                       "of the CPUs and the decode side's (kvxfer's decode, a peer's target) on the rest, as on two "
                       "machines; every contestant alike (throughput, --tp and --small-requests cases)")
    bench.add_argument("--decodes", type=integer(2), default=16,
                       help="--first-request: fresh decode processes (at least 2)")
    bench.add_argument("--steady", type=integer(1), default=8, help="--first-request: steady requests per decode")
    ttft = bench.add_argument_group(
        "--ttft", "instead of throughput: prefill start to the decode's READABLE for a modelled prefill of L layers, "
        "layer-wise sends against whole-request, beside the compute-only floor (kvxfer/tools/bench/ttft.py)")
    ttft.add_argument("--ttft", action="store_true", help="run the time-to-first-token bench (default: not run)")
    ttft.add_argument("--ttft-tokens", default=None, metavar="N,N,...",
                      help="prompt lengths (default 128,256,...,32768)")
    ttft.add_argument("--model-params", type=number(above=0), default=8.0e9, help="model parameters (default 8e9)")
    ttft.add_argument("--model-layers", type=integer(1), default=32, help="layers (default 32)")
    ttft.add_argument("--model-hidden", type=integer(1), default=4096,
                      help="hidden size, for attention FLOPs (default 4096)")
    ttft.add_argument("--model-kv-heads", type=integer(1), default=8, help="KV heads (default 8)")
    ttft.add_argument("--model-head-dim", type=integer(1), default=128, help="head dimension (default 128)")
    ttft.add_argument("--flops", type=number(above=0), default=1.0e14,
                      help="sustained FLOP/s of the prefill (default 1e14)")
    ttft.add_argument("--ttft-page-size", type=integer(1), default=64, help="tokens per page (default 64)")
    ttft.add_argument("--layerwise-min-tokens", type=integer(0), default=None,
                      help="the switch point of the auto column (default: EngineConfig's layerwise_min_tokens)")
    bench.add_argument("--json", metavar="PATH", type=output_path,
                       help="write every case and ratio as JSON (default: not written)")
    bench.add_argument("--no-progress", action="store_true",
                       help="no live progress bar (default: a bar when stdout is a terminal)")
    bench.set_defaults(func=_bench, check=_check_bench)

    audit = sub.add_parser("audit", help="deployment audits: capacity band, leak probe")
    audit_sub = audit.add_subparsers(dest="audit_command", required=True)
    capacity = audit_sub.add_parser("capacity", help="find prompt lengths that pass the context check but not the pool")
    _lazy(capacity, "kvxfer.tools.audit.capacity")
    probe = audit_sub.add_parser("probe", help="boundary test: an over-length prompt must fail and leak nothing")
    _lazy(probe, "kvxfer.tools.audit.probe")

    keygen = sub.add_parser("keygen", help="key pairs for an authenticated control plane (CurveZMQ)",
                            description="Write DIR/NAME/ for every NAME: its key pair (self.key_secret, mode 0600) "
                                        "and the public keys of all the NAMEs (trusted/). Give each engine its "
                                        "directory as EngineConfig(keyring=...) or KVXFER_KEYRING.")
    keygen.add_argument("directory", help="where to write one keyring folder per NAME (created if missing)")
    keygen.add_argument("names", nargs="+", metavar="NAME", help="engine or node names, e.g. prefill0 decode0")
    keygen.add_argument("--force", action="store_true", help="replace existing keyrings of these names")
    keygen.set_defaults(func=_keygen, check=_check_keygen)

    toy = sub.add_parser("serve-toy", help="a toy HTTP model on kvxfer engines to probe (safe or --unsafe-legacy)")
    toy.add_argument("--host", default="127.0.0.1", help="address to serve HTTP on")
    toy.add_argument("--port", type=port(allow_zero=True), default=30000,
                     help="port to serve HTTP on; 0 picks a free port")
    toy.add_argument("--page-size", type=integer(1), default=16, help="tokens per page")
    toy.add_argument("--prefill-pages", type=integer(1), default=256, help="pages in the prefill pool")
    toy.add_argument("--decode-pages", type=integer(1), default=2048, help="pages in the decode pool")
    toy.add_argument("--context", type=integer(1), default=32768, help="advertised context length (tokens)")
    toy.add_argument("--token-cost-us", type=number(0), default=50.0, help="simulated prefill time per token")
    toy.add_argument("--unsafe-legacy", action="store_true", help="reproduce the incident (placeholder prefill)")
    toy.add_argument("--max-seconds", type=number(above=0), default=None, metavar="S",
                     help="stop serving after S seconds (default: serve until stopped)")
    toy.set_defaults(func=_serve_toy, check=_check_toy)

    fleet = sub.add_parser("fleet", help="one prefill against many decode engines peering at once (storms)")
    _lazy(fleet, "kvxfer.tools.fleet")

    simulate = sub.add_parser("simulate", help="exposure simulation of the incident path over the real page ledger")
    _lazy(simulate, "kvxfer.tools.simulate")
    _name_commands(parser)
    return parser


def _name_commands(parser: argparse.ArgumentParser) -> None:
    """Every subcommand records its name (``prog``, "kvxfer audit probe"): the one-line errors start with it."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                sub.set_defaults(command_prog=sub.prog)
                _name_commands(sub)


def _lazy(parser: argparse.ArgumentParser, module: str) -> None:
    """A subcommand whose options and body live in ``module`` (imported only when used)."""
    import importlib

    mod = importlib.import_module(module)
    mod.add_arguments(parser)
    parser.set_defaults(func=mod.main, check=getattr(mod, "check", None))


def _check_keygen(args: argparse.Namespace) -> None:
    """Distinct, usable NAMEs; a directory that exists as one, or can be made; no keyring replaced
    without --force."""
    from ..errors import ConfigError
    from ..wire.auth import _safe
    from .checks import directory_creatable

    seen: dict[str, str] = {}
    for name in args.names:
        try:
            folder = _safe(name)
        except ConfigError:
            raise ConfigError(f"NAME {name!r}: has no usable characters (letters, digits, '-', '_', '.')") from None
        if folder in seen:
            raise ConfigError(f"NAME {name!r}: given twice" + (f" (as {seen[folder]!r})" if seen[folder] != name else ""))
        seen[folder] = name
    directory_creatable("directory", args.directory)
    existing = [os.path.join(args.directory, folder) for folder in seen
                if os.path.exists(os.path.join(args.directory, folder))]
    if existing and not args.force:
        raise ConfigError(f"--force: {', '.join(existing)} already exist (pass --force to replace)")


def _keygen(args: argparse.Namespace) -> int:
    from ..errors import ConfigError
    from ..wire.auth import write_cluster

    try:
        paths = write_cluster(args.directory, args.names, force=args.force)
    except OSError as exc:  # what the check cannot see: /proc, a full disk, a read-only mount
        raise ConfigError(f"directory {args.directory}: cannot write the keyrings there: "
                          f"{exc.strerror or exc}") from None
    for path in paths:
        print(f"{path}: key pair and {len(args.names)} trusted public keys")
    return 0


def _check_toy(args: argparse.Namespace) -> None:
    """The decode pool holds the context, both pools fit this machine, the HTTP port is free."""
    from ..errors import ConfigError
    from .checks import memory_for, port_free
    from .toy import SLOT

    if args.decode_pages * args.page_size < args.context:
        raise ConfigError(f"--decode-pages {args.decode_pages} x --page-size {args.page_size} hold "
                          f"{args.decode_pages * args.page_size:,} tokens, fewer than --context {args.context:,}: "
                          "the decode pool must hold the advertised context")
    memory_for(f"--page-size {args.page_size} with --prefill-pages {args.prefill_pages} and --decode-pages "
               f"{args.decode_pages} ({SLOT} B per token)",
               [("prefill pool", args.prefill_pages * args.page_size * SLOT),
                ("decode pool", args.decode_pages * args.page_size * SLOT)])
    port_free("--port", args.host, args.port, host_flag="--host")


def _serve_toy(args: argparse.Namespace) -> int:
    from .toy import ToyConfig, serve

    return serve(ToyConfig(host=args.host, port=args.port, page_size=args.page_size,
                           prefill_pages=args.prefill_pages, decode_pages=args.decode_pages, context=args.context,
                           token_cost_us=args.token_cost_us, unsafe_legacy=args.unsafe_legacy,
                           max_seconds=args.max_seconds))


def _counts(text: str) -> list[int]:
    """``"1,8,64"`` -> [1, 8, 64]; [] when any is not a positive integer."""
    try:
        values = [int(t) for t in text.split(",")]
    except ValueError:
        return []
    return values if values and min(values) > 0 else []


def _ttft_config(args: argparse.Namespace) -> Any:
    from ..engine import EngineConfig
    from ..errors import ConfigError
    from .bench.ttft import DEFAULT_TOKENS, TtftConfig, TtftModel

    tokens = _counts(args.ttft_tokens) if args.ttft_tokens else list(DEFAULT_TOKENS)
    if not tokens:
        raise ConfigError(f"--ttft-tokens takes integers above 0 separated by commas, not {args.ttft_tokens!r}")
    model = TtftModel(params=args.model_params, layers=args.model_layers, hidden=args.model_hidden,
                      kv_heads=args.model_kv_heads, head_dim=args.model_head_dim, flops=args.flops)
    switch = args.layerwise_min_tokens
    if switch is None:
        switch = EngineConfig.from_env(max_context=max(tokens)).layerwise_min_tokens
    return TtftConfig(model=model, tokens=sorted(set(tokens)), transport=args.engine["transport"],
                      page_size=args.ttft_page_size, repeat=max(1, args.repeat if args.repeat != 5 else 3),
                      checks="off" if args.checks == "off" else "on", layerwise_min_tokens=switch,
                      transport_options=args.engine.get("transport_options") or {})


def _check_bench(args: argparse.Namespace) -> None:
    """Build the run's BenchConfig (or --ttft's), ConfigError naming the flag; the pools must fit here."""
    from ..errors import ConfigError
    from .bench import BenchConfig
    from .bench.baselines import RUNNERS

    if args.busy_caller and args.small_requests is None:
        raise ConfigError("--busy-caller applies to --small-requests only")
    if args.ttft:
        args.bench_config = _ttft_config(args)
        _check_ttft_memory(args.bench_config)
        return
    defaults = BenchConfig()
    transport = args.engine["transport"]
    baselines = defaults.baselines
    if args.baselines is not None and args.baselines.strip() == "none":
        baselines = []  # kvxfer's own cases only
    elif args.baselines is not None:
        baselines = [name.strip() for name in args.baselines.split(",") if name.strip()]
        unknown = [name for name in baselines if name not in RUNNERS]
        if unknown or not baselines:
            raise ConfigError(f"--baselines {args.baselines}: unknown baseline {', '.join(map(repr, unknown)) or '(none)'}"
                              f" (known: {', '.join(RUNNERS)})")
    small = None
    if args.small_requests is not None:
        small = _counts(args.small_requests)
        if not small:
            raise ConfigError(f"--small-requests takes page counts above 0 separated by commas, not "
                              f"{args.small_requests!r}")
    config = BenchConfig(
        **args.engine,
        total_bytes=args.total or (defaults.total_bytes if transport != "verbs" else 64 << 20),
        total_bytes_small_pages=args.total_small,
        page_sizes=list(args.page_bytes) if args.page_bytes else defaults.page_sizes,
        request_bytes=args.request_bytes,
        concurrency=args.concurrency,
        repeat=args.repeat,
        checks=args.checks,
        baselines=baselines,
        compare_windows=args.compare_windows,
        tp=args.tp,
        first_request=args.first_request,
        first_request_decodes=args.decodes,
        first_request_steady=args.steady,
        # a transport named by the flag or KVXFER_TRANSPORT: that one; else every transport here
        first_request_transports=[transport] if args.transport or os.environ.get("KVXFER_TRANSPORT") else None,
        small_requests=small,
        small_requests_count=max(2, args.requests),
        caller_busy_ms=args.busy_caller,
        pin=args.pin,
    )
    if args.first_request and not args.page_bytes:
        config.page_sizes = [65536]
    if config.tp:
        from .bench.tp import parse_tp, tp_shape

        parse_tp(config.tp)  # ConfigError naming --tp
        for page in config.page_sizes:
            try:
                tp_shape(page)
            except ConfigError as exc:
                raise ConfigError(f"--tp {config.tp} with --page-bytes {page}: {exc}") from None
    if config.first_request:
        _check_first_request_memory(config)
    elif config.small_requests:
        _check_small_requests_memory(config)
    else:
        _check_bench_memory(config)
    args.bench_config = config


def _bench_pools(config: Any, page: int) -> list[tuple[str, int]]:
    """(what, bytes) of the pools of one page size's kvxfer cases, all started before the rounds."""
    from .bench.cases import _geometry

    cases = (2 if config.checks == "both" else 1) * (2 if config.compare_windows and config.transport == "verbs" else 1)
    cases *= 2 if config.compare_inline and config.transport in ("tcp", "shm") else 1
    _pages, per_request, _requests, pool_pages = _geometry(config, page)
    return [("decode pool", pool_pages * page), ("prefill pool", (pool_pages // 2 + per_request) * page)] * cases


def _check_bench_memory(config: Any) -> None:
    """The pools of a page size's kvxfer cases (all started before the rounds) must fit this machine."""
    from .checks import human_bytes, memory_for

    for page in sorted(set(config.page_sizes), reverse=True):
        memory_for(f"--request-bytes {human_bytes(config.request_bytes)} x --concurrency {config.concurrency} "
                   f"(pools of 2 x concurrency requests) at --page-bytes {page}", _bench_pools(config, page))


def _check_small_requests_memory(config: Any) -> None:
    """--small-requests: the pools of its largest request at each page size (one size runs at a time)."""
    from .bench.small import DEFAULT_PAGES, _config_for
    from .checks import memory_for

    pages = max(config.small_requests or DEFAULT_PAGES)
    for page in sorted(set(config.page_sizes), reverse=True):
        memory_for(f"--small-requests of {pages} pages at --page-bytes {page} (pools of 2 requests)",
                   _bench_pools(_config_for(config, page, pages), page))


def _check_first_request_memory(config: Any) -> None:
    """--first-request: the long-lived prefill's pool and one fresh decode's, 2 requests each, at each page size."""
    from .checks import human_bytes, memory_for

    for page in sorted(set(config.page_sizes), reverse=True):
        pool = 2 * max(1, config.request_bytes // page) * page
        memory_for(f"--first-request with --request-bytes {human_bytes(config.request_bytes)} at --page-bytes {page} "
                   "(pools of 2 requests)", [("prefill pool", pool), ("decode pool", pool)])


def _check_ttft_memory(config: Any) -> None:
    """--ttft: the prefill's and the decode's pools hold the longest prompt, K and V of every layer."""
    from .checks import human_bytes, memory_for

    model = config.model
    pages = -(-max(config.tokens) // config.page_size) + 1
    pool = pages * config.page_size * model.kv_bytes_per_token()
    memory_for(f"--ttft-tokens {max(config.tokens):,} x --model-layers {model.layers} x --model-kv-heads "
               f"{model.kv_heads} x --model-head-dim {model.head_dim} ({human_bytes(model.kv_bytes_per_token())} "
               "per token)", [("prefill pool", pool), ("decode pool", pool)])


def _bench(args: argparse.Namespace) -> int:
    progress = False if args.no_progress else None
    if args.ttft:
        from .bench.ttft import run_ttft

        return run_ttft(args.bench_config, json_path=args.json, progress=progress)
    from .bench import run_bench

    return run_bench(args.bench_config, json_path=args.json, progress=progress)


def _transport_flags(parser: argparse.ArgumentParser) -> None:
    """--transport (the registry's transports) and the verbs options; unset flags fall back to
    KVXFER_* variables (EngineConfig.from_env), then to EngineConfig's defaults."""
    from ..transport.registry import names

    parser.add_argument("--transport", default=None, choices=names(),
                        help="data transport (default: $KVXFER_TRANSPORT, else tcp)")
    parser.add_argument("--ib-device", default=None,
                        help="verbs: RDMA device (default: $KVXFER_IB_DEVICE, else the first with an active port)")
    parser.add_argument("--gid-index", type=integer(0, 255, "a GID table index"), default=None,
                        help="verbs: GID index (default: $KVXFER_GID_INDEX, else the first RoCE v2 "
                        "IPv4-mapped GID)")
    parser.add_argument("--ib-windows", default=None, choices=["auto", "on", "off"],
                        help="verbs: per-request memory windows (default: $KVXFER_IB_WINDOWS, else auto: "
                        "where the device has them)")


def _engine_settings(args: argparse.Namespace) -> dict[str, Any]:
    """``transport`` and ``transport_options`` for the engines a command starts: the KVXFER_*
    variables, then the flags given (EngineConfig.from_env); ConfigError for a bad variable."""
    from ..engine.config import EngineConfig

    overrides: dict[str, Any] = {}
    if args.transport is not None:
        overrides["transport"] = args.transport
    else:
        _check_transport_variable()
    verbs = {key: value for key, value in (("device", args.ib_device), ("gid_index", args.gid_index),
                                           ("windows", args.ib_windows)) if value is not None}
    if verbs:
        overrides["transport_options"] = {"verbs": verbs}
    # only the transport settings are taken: the engines these commands start bind loopback (or run
    # authenticated), so a KVXFER_HOST meant for a deployment does not stop them
    overrides.setdefault("host", "127.0.0.1")
    config = EngineConfig.from_env(max_context=_ANY_CONTEXT, **overrides)
    return {"transport": config.transport, "transport_options": config.to_dict()["transport_options"]}


def _check_transport_variable() -> None:
    """ConfigError naming ``KVXFER_TRANSPORT=<value>`` when the variable names no registered transport."""
    from ..errors import ConfigError
    from ..transport.registry import names

    value = (os.environ.get("KVXFER_TRANSPORT") or "").strip()
    if value and value not in names():
        raise ConfigError(f"KVXFER_TRANSPORT={value}: unknown transport {value!r} (available: {', '.join(names())})")


def _fault_names() -> list[str]:
    from .stress.workload import ALL_FAULTS

    return list(ALL_FAULTS)


def _net_fault_names() -> list[str]:
    from .stress.workload import NET_FAULTS

    return list(NET_FAULTS)


def _version() -> str:
    from .._version import __version__

    return __version__


STOPPABLE = ("demo", "stress", "bench", "serve-toy", "fleet")


def _check_transport(args: argparse.Namespace) -> None:
    """The transport the engines will use runs here (its libraries import, a device exists)."""
    from .checks import transport_runs

    name = args.engine["transport"]
    if args.transport is not None:
        label = f"--transport {name}"
    elif os.environ.get("KVXFER_TRANSPORT"):
        label = f"KVXFER_TRANSPORT={name}"
    else:
        label = f"--transport {name} (the default)"
    if args.command == "bench" and getattr(args, "first_request", False) and label.endswith("(the default)"):
        return  # every transport this machine runs; it says which it skips
    transport_runs(label, name)
    verbs = (args.engine.get("transport_options") or {}).get("verbs") or {}
    if name == "verbs" and isinstance(verbs, dict) and verbs.get("windows") == "on":
        from ..errors import ConfigError
        from ..transport.verbs import native_verbs

        native = native_verbs()
        if native is None or not hasattr(native, "post_binds"):
            flag = "--ib-windows on" if args.ib_windows else "KVXFER_IB_WINDOWS=on"
            raise ConfigError(f"{flag}: memory windows are bound from C and kvxfer._verbs is not built (install "
                              "libibverbs-dev and a C compiler, then reinstall kvxfer; or use --ib-windows auto)")


def _one_line(text: str) -> str:
    return " ".join(part.strip() for part in str(text).splitlines() if part.strip())


def _exit_status(exc: SystemExit) -> int:
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _note_fallback(prog: str) -> None:
    """A command that moves bytes on the pure-Python fallback says so once, unless KVXFER_PURE_PYTHON=1
    asked for it: a build without a compiler is silent otherwise, and several times slower."""
    from ..core import native

    if not native.available() and os.environ.get("KVXFER_PURE_PYTHON") != "1":
        print(f"{prog}: note: {native.describe()}; {native.INSTALL_HINT}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """Parse, check, run. A mistake is one line, ``kvxfer <command>: <reason>``, exit status 2, before any
    work; an error while working is one line too, exit status 1; ``--debug`` adds the traceback."""
    from ..errors import ConfigError, KvxferError

    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
    except SystemExit as exc:  # --help, --version, or a mistake already printed as one line
        return _exit_status(exc)
    prog = getattr(args, "command_prog", "kvxfer")
    if extra:
        print(f"{prog}: unrecognized arguments: {' '.join(extra)}", file=sys.stderr)
        return 2
    debug = args.show_traceback or os.environ.get("KVXFER_DEBUG") == "1"
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        if hasattr(args, "transport"):
            args.engine = _engine_settings(args)
        check = getattr(args, "check", None)
        if check is not None:  # what the flags ask, together; then what the machine offers
            check(args)
        if hasattr(args, "transport"):
            _check_transport(args)
        if args.command in STOPPABLE:
            from .procs import run_stoppable

            _note_fallback(prog)

            return run_stoppable(prog, lambda: int(args.func(args) or 0))
        return int(args.func(args) or 0)
    except ConfigError as exc:  # a mistake in what was asked for
        if debug:
            import traceback

            traceback.print_exc()
        print(f"{prog}: {_one_line(exc)}", file=sys.stderr)
        return 2
    except Exception as exc:  # the work failed: the reason in one line, the traceback on request
        if debug:
            import traceback

            traceback.print_exc()
        what = str(exc) if isinstance(exc, KvxferError) else f"{type(exc).__name__}: {exc}"
        hint = "" if debug else f" (kvxfer --debug {prog.removeprefix('kvxfer ')} ... shows the traceback)"
        print(f"{prog}: {_one_line(what)}{hint}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
