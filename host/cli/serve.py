"""`device-plugin-host run`: serve until SIGTERM, reload on SIGHUP or a changed file.

The process entry of the daemon: it owns what is process-wide (signal handlers, the host
lock, systemd notifications, ``gc.freeze``) so that HostApp stays an object tests and
benchmarks can start by the hundred in one process.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import sys
from typing import TYPE_CHECKING, List, Optional

from host import __version__
from host.cli.exit import EXIT_CONFIG
from host.cli.lock import HostLock, LockHeld, state_dir_of
from host.cli.reload import ConfigReloader
from host.cli.systemd import Notifier
from host.config import DEFAULT_CONFIG_PATH, Config, ConfigError
from host.config.plugins import DriverRegistry
from host.core.inotify import DirectoryWatch
from host.core.isolation import DriverCalls
from host.kubelet.socket_names import KUBELET_SOCKET, instance_id
from host.memory import collect_again, return_freed_heap

if TYPE_CHECKING:
    from host.app import HostApp

log = logging.getLogger("host")
LOCK_CHECK_S = 2.0  # how often the host checks the lock file is still the one it holds
TAKE_OVER_POLL_S = 0.05  # a successor's check whether the old host released the lock
HAND_OVER_WINDOW_S = 30.0  # streams the kubelet ends meanwhile re-register at once


async def announce_ready(app: HostApp, notifier: Notifier, config: Config) -> None:
    """READY=1 once every resource is registered, but never held hostage by a kubelet that
    is not there yet: boot ordering (cloud-init running kubeadm join after
    multi-user.target) would otherwise deadlock. Without a kubelet, serving is ready."""
    if app.ready.is_set():
        return  # on_ready already sent it
    kubelet = os.path.join(config.host.plugin_dir, KUBELET_SOCKET)
    if not os.path.exists(kubelet):
        notifier.ready(f"serving {len(app.served())} resources; waiting for the kubelet at "
                       f"{kubelet}")
        return
    try:
        await asyncio.wait_for(app.ready.wait(), config.host.register_timeout_s)
    except asyncio.TimeoutError:
        pending = [name for name, registered in app.device_plugin.registered().items()
                   if not registered]
        notifier.ready(f"serving; registration pending for {', '.join(pending)}")


def _load_rest(registry: DriverRegistry, app: HostApp) -> None:
    """Other packages' drivers that no resource uses: loaded so that a broken one is reported
    now; the host's own wait for a reload that needs them (DriverRegistry.load_pending)."""
    if registry.load_pending(other_packages_only=True):
        app.adopt_drivers(registry.with_unavailable())


def _after_start(registry: DriverRegistry, app: HostApp) -> None:
    """Every resource registered: load other packages' drivers no resource uses, then give
    back the heap the start-up burst freed (host/memory.py)."""
    _load_rest(registry, app)
    return_freed_heap()


def state_dir_problem(config: Config) -> Optional[str]:
    """Why the host must not keep state where the config says (a directory others may
    write, or not ours: they could plant files we then trust or write through), or None."""
    from host.core.fileio import private_dir_problem

    for directory in dict.fromkeys([os.path.dirname(os.path.abspath(config.host.drain_file)),
                                    os.path.abspath(config.host.dra_state_dir)]):
        problem = private_dir_problem(directory)
        if problem is not None:
            return problem
    return None


def run(config: Config, registry: DriverRegistry, config_path: Optional[str]) -> int:
    from host.app import HostApp

    drivers = registry.with_unavailable()
    if config_path is None and os.path.lexists(DEFAULT_CONFIG_PATH):
        config_path = DEFAULT_CONFIG_PATH

    async def serve() -> None:
        app = HostApp(config, drivers)
        app.instance = instance_id()
        reloader = ConfigReloader(app, config_path, registry, {
            "plugin_dir": config.host.plugin_dir, "host_root": config.host.host_root})
        notifier = Notifier()
        app.on_ready.append(lambda: notifier.ready(
            f"serving {len(app.served())} resources, all registered"))
        stop = asyncio.Event()
        terminated = asyncio.Event()  # SIGTERM/SIGINT, as opposed to a hand-over
        loop = asyncio.get_running_loop()

        def on_signal() -> None:
            terminated.set()
            stop.set()

        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, on_signal)
        warned: List[OSError] = []
        handed_over: List[str] = []  # who we handed over to
        announced: List[bool] = []  # as a successor: told the holder we are ready

        def successor_ready(names: Optional[List[str]] = None) -> None:
            """As the holder: a newer host serves and registered everything: drain."""
            if names is not None and os.path.basename(lock.successor_path) not in names:
                return
            if not lock.held or stop.is_set():
                return
            successor = lock.successor()
            if successor is not None and successor.state == "ready":
                handed_over.append(successor.describe())
                log.info("a newer host serves this node (%s): handing over", handed_over[0])
                stop.set()

        def follow() -> None:
            """As a successor: take the lock once the holder released it."""
            if stop.is_set():
                return
            if lock.take_over():
                log.info("took over the plugin directory %s from %s", config.host.plugin_dir,
                         lock.predecessor.describe() if lock.predecessor else "the old host")
                return
            app.background.later("host lock take-over", TAKE_OVER_POLL_S, follow)

        def announce_successor() -> None:
            if lock.following and not announced:
                announced.append(True)
                lock.announce_ready()
                app.device_plugin.registrar.expect_hand_over(HAND_OVER_WINDOW_S)
                log.info("serving and registered beside %s; it hands over now",
                         lock.predecessor.describe() if lock.predecessor else "the old host")
                follow()

        def take_lock(again: bool = False) -> None:
            """The lock could not be taken at start (the state directory read-only, say):
            take it as soon as it can be (when a socket of ours was bound, and at every
            check); another host that got there first stops us. ``again``: the file we
            held is gone or replaced, lock the one at the path now."""
            if (lock.held and not again) or lost_lock or lock.following:
                return
            try:
                lock.acquire()
            except LockHeld as error:
                lost_lock.append(error)
                stop.set()
            except OSError as error:
                if not warned:
                    warned.append(error)
                    log.warning("cannot lock %s (%s): a second host on this plugin directory "
                                "would not be stopped", lock.path, error.strerror or error)

        def check_lock() -> None:
            """Still ours? The lock file deleted or replaced (a cleanup of the state
            directory) would let a second host lock the new file: take it again, or stop
            if another host got there first."""
            if lock.following:
                pass  # follow() takes it once the holder hands over
            elif not lock.held:
                take_lock()
            elif not lock.still_held():
                log.warning("the host lock %s was removed or replaced; taking it again",
                            lock.path)
                take_lock(again=True)
            else:
                successor_ready()
            if not stop.is_set():
                app.background.later("host lock check", LOCK_CHECK_S, check_lock)

        if not lock.held:
            app.device_plugin.registrar.link.on_dir_usable = take_lock
        app.on_ready.append(announce_successor)
        state_watch = DirectoryWatch(lock.state_dir, successor_ready)
        state_watch.start()
        log.info("device-plugin-host %s: plugin dir %s, host root %s, %d resources configured",
                 __version__, config.host.plugin_dir, config.host.host_root,
                 len(config.resources))
        try:
            notifier.start_watchdog()
            await app.metrics.start(config.host.metrics_address)
            await app.start()
            # Everything built so far lives as long as the process: keep it out of the cyclic
            # collector, whose full passes over them would set ListAndWatch's p99. Here, at the
            # process entry, not in HostApp.start:
            # a test or benchmark process starts hosts by the hundred.
            gc.freeze()
            collect_again()  # off since the process began (host/memory.py)
            reloader.on_outcome = lambda outcome: gc.freeze() if outcome == "applied" else None
            reloader.start()
            # Other packages' drivers no resource uses load once serving (a broken package is
            # still reported; a reload loads the rest): a moment after all are registered, or
            # in 5 s. Both timers are the host's, cancelled by its stop(). The first time all
            # are registered, the freed heap of that burst goes back to the kernel too.
            app.on_ready.append(lambda: app.background.later(
                "load other drivers", 0.5, _after_start, registry, app))
            app.background.later("load other drivers (fallback)", 5.0, _load_rest, registry, app)
            app.background.later("host lock check", LOCK_CHECK_S, check_lock)
            announce = app.background.spawn(announce_ready(app, notifier, config), "readiness")
            await stop.wait()
            if announce is not None:
                announce.cancel()
            log.info("stopping: removing our sockets")
            notifier.stopping()
        finally:
            state_watch.close()
            notifier.stop_watchdog()
            await reloader.aclose()
            # Handed over (or a successor that never took over): the shared files are the
            # other host's; only our own sockets go.
            # A successor waiting (ready or not) serves the same node too: leave it the files.
            await app.stop(hand_over=bool(handed_over) or lock.following
                           or (lock.held and lock.successor() is not None))
            if handed_over:
                lock.release()  # the successor takes it at once
                log.info("handed over to %s", handed_over[0])
                if os.environ.get("KUBERNETES_SERVICE_HOST") and not terminated.is_set():
                    # A DaemonSet pod that exited (or failed its liveness probe) would be
                    # restarted and take the node back: wait, serving nothing but /healthz,
                    # until the rollout deletes this pod.
                    log.info("waiting for this pod to be deleted")
                    await terminated.wait()
            await app.metrics.stop()

    problem = state_dir_problem(config)
    if problem is not None:
        print(f"device-plugin-host: {problem}", file=sys.stderr)
        return EXIT_CONFIG
    lock = HostLock(config.host.plugin_dir, state_dir_of(config.host.drain_file))
    lost_lock: List[LockHeld] = []
    try:
        if not lock.acquire_or_follow() and lock.predecessor is not None:
            log.info("another device-plugin-host serves %s (%s): serving beside it until it "
                     "hands over", config.host.plugin_dir, lock.predecessor.describe())
    except LockHeld as error:
        print(f"device-plugin-host: {error}", file=sys.stderr)
        return EXIT_CONFIG
    except OSError as error:
        # A read-only or unusable state directory: the lock is taken once it can be
        # (take_lock: when a socket of ours was bound, and at every lock check).
        log.debug("cannot lock %s yet: %s", lock.path, error.strerror or error)
    if lock.held:  # the only host of ours: what an earlier run left can go
        from host.cli.stale import remove_stale

        remove_stale(config)
    try:
        asyncio.run(serve())
        if lost_lock:
            print(f"device-plugin-host: {lost_lock[0]}", file=sys.stderr)
            logging.shutdown()
            return EXIT_CONFIG
    except ConfigError as error:  # found only with a scan: devices two resources claim
        print(f"device-plugin-host: invalid configuration: {error}", file=sys.stderr)
        return EXIT_CONFIG
    except Exception as error:
        if type(error).__name__ != "DraStartError":  # host.dra loads only for DRA configs
            raise
        print(f"device-plugin-host: cannot serve DRA resources: {error}", file=sys.stderr)
        logging.shutdown()
        return EXIT_CONFIG
    finally:
        lock.release()
    logging.shutdown()
    if DriverCalls.stuck_threads():
        # A driver call that never returned: Python would wait for its thread forever.
        sys.stderr.flush()
        os._exit(0)
    return 0
