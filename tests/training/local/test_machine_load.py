"""The demo's busy-machine guard counts this process tree's CPU as its own, whoever reaped it: a child's,
and a grandchild's that the child waited for, are subtracted from the machine's busy time, not taken for
another program's."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from training.local.machine_load import other_cores, own_seconds


def test_a_childs_and_a_reaped_grandchilds_cpu_count_as_this_trees_own(tmp_path) -> None:
    script = tmp_path / "burn.py"
    script.write_text(textwrap.dedent("""
        import subprocess, sys, time
        def burn(seconds):
            end = time.process_time() + seconds
            while time.process_time() < end:
                pass
        burn(0.6)
        if sys.argv[1:] != ["grandchild"]:
            subprocess.run([sys.executable, __file__, "grandchild"], check=True)
            print("reaped", flush=True)
            time.sleep(60)  # alive: its reaped grandchild is in its own children fields, not yet in ours
    """))
    before = own_seconds()
    child = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "reaped"
        used_while_alive = own_seconds() - before
    finally:
        child.kill()
        child.wait()
    used = own_seconds() - before
    assert used_while_alive >= 1.2 * 0.95  # both burns (and the interpreters' start-up), however loaded the machine
    assert used >= used_while_alive * 0.99  # once reaped, nothing is lost
    # Others are what the machine's busy time holds beyond ours; never negative.
    assert other_cores(busy_delta_s=3.0, own_delta_s=2.0, wall_s=2.0) == 0.5
    assert other_cores(busy_delta_s=1.0, own_delta_s=2.0, wall_s=2.0) == 0.0 and other_cores(1.0, 0.0, 0.0) == 0.0
