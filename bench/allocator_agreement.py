"""How often the allocator model (doctor/snapshot/allocator.py) puts an allocation where torch did, on real snapshot
files (issue 34), and how much a deliberately wrong rule lowers it.

Usage: .venv/bin/python bench/allocator_agreement.py FILE_OR_FOLDER...   (snapshot pickles, .pickle/.pkl[.gz])

Per file and device: trace entries, the blocks alive at the first entry (a ring that starts mid-run has them),
streams, segment_free entries, allocations replayed, at the recorded address, segment events as recorded, the
replay's seconds. Then the pooled figures under the model and under three wrong rules (first fit instead of best
fit; never split a large block; a new segment of the request's size instead of get_allocation_size): the
figures are computed from the file, so a wrong rule must lower them. Files are read with the doctor's safe
loader; nothing is written.
"""

import glob
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from mbmem_overlays.doctor.snapshot import allocator as A  # noqa: E402
from mbmem_overlays.doctor.snapshot import load, model as M  # noqa: E402
from mbmem_overlays.doctor.snapshot.replay import Replayer, Rounding  # noqa: E402
from mbmem_overlays.doctor.snapshot.whatif import settings_of_file  # noqa: E402


def files(args):
    for arg in args:
        if os.path.isdir(arg):
            for pattern in ("*.pickle", "*.pkl", "*.pickle.gz", "*.pkl.gz"):
                yield from sorted(glob.glob(os.path.join(arg, pattern)))
        else:
            yield arg


def first_fit(self, pool, size, stream):
    best = None
    for key in pool.keys:
        if key[0] == stream and key[1] >= size and (best is None or key[2] < best[2]):
            best = key
    if best is None:
        return None
    block = pool.blocks[best]
    pool.erase(block)
    return block


WRONG = {
    "first fit": ("get_free_block", first_fit),
    "never split a large block": ("should_split", lambda self, b, size: b.pool.small and b.size - size >= 512),
    "segment of the request's size": ("allocation_size", lambda size: max(size, 2 << 20) if size <= 1 << 20
                                      else -(-size // (2 << 20)) * (2 << 20)),
}


def main(args):
    cases = []
    print(f"{'file':<44} {'dev':>3} {'entries':>8} {'live at start':>13} {'streams':>7} {'seg frees':>9} "
          f"{'allocs':>7} {'at recorded':>11} {'agreement':>10} {'segments':>11} {'s':>5}")
    for path in files(args):
        try:
            snap = M.normalize(load.load(path).data)
        except (load.SnapshotError, M.MalformedSnapshot) as exc:
            print(f"{os.path.basename(path):<44} unreadable: {exc}")
            continue
        for device, trace in sorted(snap.traces.items()):
            segments = snap.segments.get(device, [])
            settings, _ = settings_of_file(snap.allocator_settings, segments, trace)
            rounding = Rounding.from_settings(snap.allocator_settings, settings.expandable_segments)
            start = A.start_state(Replayer(segments, trace, rounding).state_at(0), segments, trace)
            t0 = time.perf_counter()
            p = A.prove(trace, start, settings, keep_choices=False)
            dt = time.perf_counter() - t0
            frees = sum(1 for a in trace.action if a == M.SEGMENT_FREE)
            agreement = "not proven" if p.not_proven else f"{p.agreement:.2%}" if p.allocations else "-"
            seg = f"{p.segments.as_recorded}/{p.segments.as_recorded + p.segments.differed}"
            print(f"{os.path.basename(path)[:44]:<44} {device:>3} {len(trace):>8,} {len(start.blocks):>13,} "
                  f"{len(set(trace.stream)):>7} {frees:>9} {p.allocations:>7,} {p.at_recorded:>11,} {agreement:>10} "
                  f"{seg:>11} {dt:>5.2f}")
            if p.not_proven:
                print(f"  not proven: {p.not_proven}")
            else:
                cases.append((trace, start, settings))
    if not cases:
        return
    print()
    for name, patch in [("the model", None), *WRONG.items()]:
        saved = None
        if patch:
            owner = A if patch[0] == "allocation_size" else A.Allocator
            saved = (owner, patch[0], getattr(owner, patch[0]))
            setattr(owner, patch[0], patch[1])
        allocs = at = seg_ok = seg_all = 0
        try:
            for trace, start, settings in cases:
                p = A.prove(trace, start, settings, keep_choices=False)
                allocs, at = allocs + p.allocations, at + p.at_recorded
                seg_ok, seg_all = seg_ok + p.segments.as_recorded, seg_all + p.segments.as_recorded + p.segments.differed
        finally:
            if saved:
                setattr(*saved)
        print(f"pooled, {name:<30}: {at:,} of {allocs:,} allocations at the recorded address ({at / allocs:.2%}); "
              f"{seg_ok:,} of {seg_all:,} segment events as recorded")


if __name__ == "__main__":
    main(sys.argv[1:] or ["."])
