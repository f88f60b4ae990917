"""Compiled kernels of the flat DP (numba), used by
:mod:`~chainer_recompute.core.solvers._dp` when numba is installed (the
``fast`` extra); the NumPy path computes the same optima.

Pure core: numpy and numba only. Importing this module imports numba and
compiles nothing: the kernels are compiled on first use and cached on disk.

The family is passed as ``P = (R, lay, all_rows, all_blk, vptr, vrows, vblk,
mptr, mnodes, node_t, node_k, trans_vals)``:

- ``R``: one uint64 record per row (so that a row is one or two cache
  lines): its set words, its boundary words, its transient-rank words
  (see :class:`._dp._Pairs`), then |L|, back(L), T(∂L), keep(∂L), block(L);
  ``lay = (nw, nwt)`` gives the word counts.
- ``all_rows``/``all_blk``: every row sorted by block(L), and that key;
  ``vrows``/``vblk`` (offsets ``vptr``): for each node, the rows that
  contain it, sorted the same way; ``mnodes`` (offsets ``mptr``): the
  maximal elements of each row.

The transitions out of row ``i`` with slack ``s`` are the proper supersets
``L'`` of ``L_i`` with ``step = block(L') - block(L_i) + back(L') +
max_{v ∈ L' \\ L_i} transient_v <= s``. Every superset contains each
maximal element of ``L_i``, so the candidates are read from the list of the
maximal element whose block window ``[block(L_i), block(L_i) + s]`` is the
shortest (∅ reads every row). A transition adds ``ΔT = T(∂L') - T(∂L' ∩
∂L)`` and ``ΔM = keep(∂L') - keep(∂L' ∩ ∂L)`` (``∂L' ∩ L ⊆ ∂L``).
"""
from __future__ import annotations

import numpy as np
from numba import njit

INF = np.iinfo(np.int64).max

_DEBRUIJN = np.uint64(0x03F79D71B4CB0A89)
_DEBRUIJN_TABLE = np.array([
    0, 1, 48, 2, 57, 49, 28, 3, 61, 58, 50, 42, 38, 29, 17, 4,
    62, 55, 59, 36, 53, 51, 43, 22, 45, 39, 33, 30, 24, 18, 12, 5,
    63, 47, 56, 27, 60, 41, 37, 16, 54, 35, 52, 21, 44, 32, 23, 11,
    46, 26, 40, 15, 34, 20, 31, 10, 25, 14, 19, 9, 13, 8, 7, 6], dtype=np.int64)

@njit(cache=True, inline="always")
def _ctz(x):
    """Index of the lowest set bit of a non-zero uint64."""
    low = x & (~x + np.uint64(1))
    return _DEBRUIJN_TABLE[(low * _DEBRUIJN) >> np.uint64(58)]


@njit(cache=True, inline="always")
def _columns(lay):
    """The record's columns of T(∂L), keep(∂L) and block(L)."""
    nw, nwt = lay
    c_size = 2 * nw + nwt
    return c_size + 2, c_size + 3, c_size + 4


@njit(cache=True, inline="always")
def _superset(R, nw, c_size, i, j):
    """Whether row ``j``'s set is a proper superset of row ``i``'s."""
    if R[j, c_size] <= R[i, c_size]:
        return False
    miss = np.uint64(0)
    for w in range(nw):
        miss |= R[i, w] & ~R[j, w]
    return miss == 0


@njit(cache=True, inline="always")
def _transient(R, nw, nwt, trans_vals, i, j):
    """The largest transient of L_j \\ L_i (``nwt > 0``): the value of the
    first node of that difference in transient-rank order."""
    for w in range(nwt):
        x = R[j, 2 * nw + w] & ~R[i, 2 * nw + w]
        if x != 0:
            return trans_vals[64 * w + _ctz(x)]
    return trans_vals[0] * 0


@njit(cache=True, inline="always")
def _step(R, nw, nwt, trans_vals, key, bi, i, j, slack, has_budget):
    """The memory a block from row ``i`` to row ``j`` needs while it runs
    (``key``: row ``j``'s block key in the window, ``bi``: row ``i``'s),
    or -1 when ``j`` is not a proper superset of ``i`` or the step passes
    ``slack`` (``has_budget``): the test every kernel but :func:`dense`
    makes of a transition (see the module doc)."""
    c_size = 2 * nw + nwt
    if not _superset(R, nw, c_size, i, j):
        return -1
    step = key - bi + np.int64(R[j, c_size + 1])
    if has_budget and step > slack:
        return -1
    if nwt > 0:
        step += _transient(R, nw, nwt, trans_vals, i, j)
        if has_budget and step > slack:
            return -1
    return step


@njit(cache=True, inline="always")
def _deltas(R, nw, nwt, node_t, node_k, i, j):
    """``(ΔT, ΔM)`` of the transition from row ``i`` to row ``j``: T and
    keep of ∂L' less those of ∂L' ∩ ∂L. Inlined into every kernel."""
    c_size = 2 * nw + nwt
    d_t = np.int64(R[j, c_size + 2])
    d_m = np.int64(R[j, c_size + 3])
    for w in range(nw):
        x = R[j, nw + w] & R[i, nw + w]
        while x != 0:
            v = 64 * w + _ctz(x)
            d_t -= node_t[v]
            d_m -= node_k[v]
            x &= x - np.uint64(1)
    return d_t, d_m


@njit(cache=True)
def _window(P, i, slack, has_slack):
    """(use the node lists?, lo, hi): the candidate rows of row ``i``."""
    R, lay, all_rows, all_blk, vptr, vrows, vblk, mptr, mnodes, node_t, node_k, trans_vals = P
    nw, nwt = lay
    bi = np.int64(R[i, 2 * nw + nwt + 4])
    top = bi + slack
    use_v = False
    lo = np.searchsorted(all_blk, bi)
    hi = np.searchsorted(all_blk, top, side="right") if has_slack else len(all_blk)
    for q in range(mptr[i], mptr[i + 1]):
        v = mnodes[q]
        a = vptr[v]
        e = vptr[v + 1]
        seg = vblk[a:e]
        l2 = a + np.searchsorted(seg, bi)
        h2 = a + (np.searchsorted(seg, top, side="right") if has_slack else e - a)
        if h2 - l2 < hi - lo:
            use_v = True
            lo = l2
            hi = h2
    return use_v, lo, hi


@njit(cache=True)
def feasibility(P, budget, has_budget):
    """least[L]: the least retained memory reaching row L (INF when none),
    and the row it came from; the number of transitions tried."""
    R, lay, all_rows, all_blk, vptr, vrows, vblk, mptr, mnodes, node_t, node_k, trans_vals = P
    nw, nwt = lay
    c_tb, c_kb, c_blk = _columns(lay)
    K = R.shape[0]
    least = np.full(K, INF, dtype=np.int64)
    src = np.full(K, -1, dtype=np.int64)
    least[0] = 0
    n = 0
    for i in range(K - 1):
        li = least[i]
        if li == INF:
            continue
        slack = budget - li
        use_v, lo, hi = _window(P, i, slack, has_budget)
        rows = vrows if use_v else all_rows
        keys = vblk if use_v else all_blk
        bi = np.int64(R[i, c_blk])
        for p in range(lo, hi):
            j = rows[p]
            if _step(R, nw, nwt, trans_vals, keys[p], bi, i, j, slack, has_budget) < 0:
                continue
            d_t, d_m = _deltas(R, nw, nwt, node_t, node_k, i, j)
            n += 1
            v = li + d_m
            if v < least[j]:
                least[j] = v
                src[j] = i
    return least, src, n


@njit(cache=True)
def capacity(P, budget):
    """cap[L]: the most retained memory with which V is still reachable
    from L within the budget (-1 when it is not). A chain reaching L has
    kept at least ∂(L), so the slack out of L is at most budget - keep(∂L).
    V's is unbounded: what the last block keeps (the nodes every plan keeps,
    Graph.must_keep) is held during no later block."""
    R, lay, all_rows, all_blk, vptr, vrows, vblk, mptr, mnodes, node_t, node_k, trans_vals = P
    nw, nwt = lay
    c_tb, c_kb, c_blk = _columns(lay)
    K = R.shape[0]
    cap = np.full(K, -1, dtype=np.int64)
    cap[K - 1] = INF // 4
    for i in range(K - 2, -1, -1):
        kbi = np.int64(R[i, c_kb])
        if kbi > budget:
            continue
        slack = budget - kbi
        use_v, lo, hi = _window(P, i, slack, True)
        rows = vrows if use_v else all_rows
        keys = vblk if use_v else all_blk
        bi = np.int64(R[i, c_blk])
        best = -1
        for p in range(lo, hi):
            j = rows[p]
            cj = cap[j]
            if cj <= best:  # min(.., cj - ΔM) cannot beat best (ΔM >= 0)
                continue
            step = _step(R, nw, nwt, trans_vals, keys[p], bi, i, j, slack, True)
            if step < 0:
                continue
            if budget - step <= best:
                continue
            d_t, d_m = _deltas(R, nw, nwt, node_t, node_k, i, j)
            val = cj - d_m
            if budget - step < val:
                val = budget - step
            if val > best:
                best = val
        cap[i] = best
    return cap


@njit(cache=True)
def greedy(P, budget, has_budget, tc, cap, lam):
    """One state per row, the best objective (most retained time for tc,
    least for mc; then least memory; with ``lam > 0``, retained time less
    ``lam`` per retained byte) among those that can still reach V: a
    feasible chain quickly, whose retained time bounds the optimum.
    Returns (t, m, src) per row."""
    R, lay, all_rows, all_blk, vptr, vrows, vblk, mptr, mnodes, node_t, node_k, trans_vals = P
    nw, nwt = lay
    c_tb, c_kb, c_blk = _columns(lay)
    K = R.shape[0]
    bt = np.full(K, -1, dtype=np.int64)
    bm = np.full(K, INF, dtype=np.int64)
    src = np.full(K, -1, dtype=np.int64)
    bt[0] = 0
    bm[0] = 0
    sgn = 1.0 if tc else -1.0
    for i in range(K - 1):
        m = bm[i]
        if m == INF:
            continue
        t = bt[i]
        slack = budget - m
        use_v, lo, hi = _window(P, i, slack, has_budget)
        rows = vrows if use_v else all_rows
        keys = vblk if use_v else all_blk
        bi = np.int64(R[i, c_blk])
        for p in range(lo, hi):
            j = rows[p]
            if has_budget and cap[j] < m:
                continue
            if _step(R, nw, nwt, trans_vals, keys[p], bi, i, j, slack, has_budget) < 0:
                continue
            d_t, d_m = _deltas(R, nw, nwt, node_t, node_k, i, j)
            nm = m + d_m
            if has_budget and nm > cap[j]:
                continue
            nt = t + d_t
            if bm[j] != INF:
                if lam > 0.0:
                    a = sgn * nt - lam * nm
                    b = sgn * bt[j] - lam * bm[j]
                    if a < b or (a == b and nm >= bm[j]):
                        continue
                elif tc:
                    if nt < bt[j] or (nt == bt[j] and nm >= bm[j]):
                        continue
                else:
                    if nt > bt[j] or (nt == bt[j] and nm >= bm[j]):
                        continue
            bt[j] = nt
            bm[j] = nm
            src[j] = i
    return bt, bm, src


@njit(cache=True)
def dense(P, budget, has_budget, tc, cap, T, bound, incumbent, off, t0, opt, src, touched,
          max_pushes):
    """The DP over a dense table: ``opt[off[L] + t - t0[L]]`` is the least
    retained memory of a chain ending at row L with retained time t, for
    ``t0[L] <= t < t0[L] + off[L + 1] - off[L]`` (INF when none; the
    caller sizes each row to the retained times that can occur there and
    survive the pruning below); ``src`` holds the entry each one came
    from. Rows are expanded in order; each row's Pareto-optimal entries
    are pushed to every allowed superset.

    Pruning that keeps the optimum: a push to row L' with retained time t'
    is dropped when even ``t' + bound[L']`` (tc: the most retained time any
    continuation can add) falls short of ``incumbent`` (the retained time
    of a known feasible chain), or for mc when ``t' + bound[L']`` (the
    least it can add) exceeds it; and when its memory exceeds cap[L'].
    ``touched[L]`` is set for every row written: a row is filled with INF
    when first written, and rows not touched are never read (so the table
    may come from ``np.empty``: its untouched pages are never faulted in,
    and a reset is ``touched[:] = False``). A push outside its row's range
    is dropped (none is, with the caller's ranges). Returns the number of
    pushes, or -1 when the run stopped after ``max_pushes`` (> 0) pushes
    (the table is then partial)."""
    R, lay, all_rows, all_blk, vptr, vrows, vblk, mptr, mnodes, node_t, node_k, trans_vals = P
    nw, nwt = lay
    c_size = 2 * nw + nwt
    c_tb, c_kb, c_blk = _columns(lay)
    K = R.shape[0]
    ts = np.empty(T + 1, dtype=np.int64)
    ms = np.empty(T + 1, dtype=np.int64)
    opt[off[0]:off[1]] = INF
    opt[off[0] - t0[0]] = 0
    touched[0] = True
    pushes = 0
    for i in range(K - 1):
        if cap[i] < 0 or not touched[i]:
            continue
        if max_pushes > 0 and pushes > max_pushes:
            return -1
        # The row's Pareto-optimal entries, by increasing memory.
        n = 0
        run = INF
        base = off[i] - t0[i]  # row i's entry of time t is base + t
        src_base = base
        t_top = t0[i] + off[i + 1] - off[i] - 1
        # tc: from the most retained time down; mc: up from the least
        first, stop, by = (t_top, t0[i] - 1, -1) if tc else (t0[i], t_top + 1, 1)
        for t in range(first, stop, by):
            m = opt[base + t]
            if m < run:
                run = m
                ts[n] = t
                ms[n] = m
                n += 1
        if n == 0:
            continue
        for a in range(n // 2):
            b = n - 1 - a
            ts[a], ts[b] = ts[b], ts[a]
            ms[a], ms[b] = ms[b], ms[a]
        # tc: retained time increases along the list, so the states that
        # cannot reach the incumbent are a prefix; mc: it decreases, and
        # the states above the incumbent are a prefix.
        t_hi = ts[n - 1] if tc else ts[0]
        slack = budget - ms[0]
        use_v, lo, hi = _window(P, i, slack, has_budget)
        rows = vrows if use_v else all_rows
        keys = vblk if use_v else all_blk
        bi = np.int64(R[i, c_blk])
        for p in range(lo, hi):
            j = rows[p]
            if has_budget and cap[j] < ms[0]:
                continue
            # tc: ΔT <= T(∂L'), so the best this pair can give is known early.
            if tc and t_hi + np.int64(R[j, c_tb]) + bound[j] < incumbent:
                continue
            # Proper superset within the slack? (see the module doc; the
            # predicates' bodies written out here: inlined, they made this
            # kernel slower)
            if R[j, c_size] <= R[i, c_size]:
                continue
            miss = np.uint64(0)
            for w in range(nw):
                miss |= R[i, w] & ~R[j, w]
            if miss != 0:
                continue
            step = keys[p] - bi + np.int64(R[j, c_size + 1])
            if has_budget and step > slack:
                continue
            if nwt > 0:
                for w in range(nwt):
                    x = R[j, 2 * nw + w] & ~R[i, 2 * nw + w]
                    if x != 0:
                        step += trans_vals[64 * w + _ctz(x)]
                        break
                if has_budget and step > slack:
                    continue
            d_t = np.int64(R[j, c_tb])
            d_m = np.int64(R[j, c_kb])
            for w in range(nw):
                x = R[j, nw + w] & R[i, nw + w]
                while x != 0:
                    v = 64 * w + _ctz(x)
                    d_t -= node_t[v]
                    d_m -= node_k[v]
                    x &= x - np.uint64(1)
            lim = INF
            if has_budget:
                lim = budget - step
                lc = cap[j] - d_m
                if lc < lim:
                    lim = lc
            lo_ = 0
            hi_ = n
            if tc:
                need = incumbent - d_t - bound[j]
                if t_hi < need:
                    continue
                while lo_ < hi_:
                    mid = (lo_ + hi_) >> 1
                    if ts[mid] < need:
                        lo_ = mid + 1
                    else:
                        hi_ = mid
            else:
                allow = incumbent - d_t - bound[j]
                while lo_ < hi_:
                    mid = (lo_ + hi_) >> 1
                    if ts[mid] > allow:
                        lo_ = mid + 1
                    else:
                        hi_ = mid
            s = lo_
            if s < n and ms[s] <= lim and not touched[j]:
                opt[off[j]:off[j + 1]] = INF  # rows are initialised when first written
                touched[j] = True
            base = off[j] - t0[j]
            r_lo = t0[j]
            r_hi = t0[j] + off[j + 1] - off[j] - 1
            while s < n:
                m = ms[s]
                if m > lim:
                    break
                nt = ts[s] + d_t
                nm = m + d_m
                if r_lo <= nt <= r_hi and nm < opt[base + nt]:
                    opt[base + nt] = nm
                    src[base + nt] = src_base + ts[s]
                pushes += 1
                s += 1
    return pushes


@njit(cache=True)
def count_states(opt, off, touched):
    """The entries of :func:`dense`'s table that hold a state."""
    n = 0
    for r in range(len(touched)):
        if touched[r]:
            for e in range(off[r], off[r + 1]):
                if opt[e] != INF:
                    n += 1
    return n


# ------------------------------------------------------------ the family
# Kernels that build a :class:`~chainer_recompute.core.lower_sets.LowerSetFamily`
# (the NumPy functions of :mod:`~chainer_recompute.core.lower_sets` compute the
# same arrays); sets are rows of uint64 words, ``pw``/``sw`` the predecessor
# and successor words of each node.

@njit(cache=True)
def enum_lower_sets(pw, limit):
    """Every lower set, grown node by node in topological order (the rows in
    the order of :func:`~chainer_recompute.core.lower_sets._enumerate_words`).
    Returns (rows, v): v is the node after which the count first exceeded
    ``limit`` (``limit < 0``: none), else -1."""
    n, nw = pw.shape
    cap = 64
    out = np.zeros((cap, nw), dtype=np.uint64)
    K = 1
    for v in range(n):
        w = v >> 6
        bit = np.uint64(1) << np.uint64(v & 63)
        K0 = K
        for i in range(K0):
            ok = True
            for q in range(nw):
                p = pw[v, q]
                if (out[i, q] & p) != p:
                    ok = False
                    break
            if not ok:
                continue
            if K == cap:
                cap *= 2
                grown = np.zeros((cap, nw), dtype=np.uint64)
                grown[:K] = out[:K]
                out = grown
            for q in range(nw):
                out[K, q] = out[i, q]
            out[K, w] |= bit
            K += 1
        if limit >= 0 and K > limit:
            return out[:K], v
    return out[:K], -1


@njit(cache=True, inline="always")
def _row_nodes(words, r, buf):
    """Write the nodes of row ``r`` into ``buf`` (lowest first); returns
    how many."""
    nw = words.shape[1]
    one = np.uint64(1)
    k = 0
    for q in range(nw):
        x = words[r, q]
        while x != 0:
            buf[k] = 64 * q + _ctz(x)
            x &= x - one
            k += 1
    return k


@njit(cache=True)
def derive(words, sw, pw):
    """∂(L), A(L) = δ+(L) \\ L and B(L) = δ-(A(L)) \\ L of every row."""
    K, nw = words.shape
    bnd = np.zeros((K, nw), dtype=np.uint64)
    a = np.zeros((K, nw), dtype=np.uint64)
    b = np.zeros((K, nw), dtype=np.uint64)
    buf = np.empty(64 * nw, dtype=np.int64)
    one = np.uint64(1)
    for r in range(K):
        for k in range(_row_nodes(words, r, buf)):
            v = buf[k]
            hit = False
            for t in range(nw):
                y = sw[v, t] & ~words[r, t]
                if y != 0:
                    hit = True
                    a[r, t] |= y
            if hit:
                bnd[r, v >> 6] |= one << np.uint64(v & 63)
        for k in range(_row_nodes(a, r, buf)):
            for t in range(nw):
                b[r, t] |= pw[buf[k], t] & ~words[r, t]
    return bnd, a, b


@njit(cache=True)
def wsum(words, weights):
    """Σ weights[v] over the bits of each row (int64); |L| with weights
    of ones."""
    K, nw = words.shape
    out = np.zeros(K, dtype=np.int64)
    buf = np.empty(64 * nw, dtype=np.int64)
    for r in range(K):
        s = 0
        for k in range(_row_nodes(words, r, buf)):
            s += weights[buf[k]]
        out[r] = s
    return out


@njit(cache=True, inline="always")
def _maximal(words, sw, r, v, nw):
    """Whether node ``v`` of row ``r`` has no successor in the row."""
    for t in range(nw):
        if sw[v, t] & words[r, t]:
            return False
    return True


@njit(cache=True)
def node_lists(words, order, sw, n):
    """For the kernels' ``P``: the positions (in ``order``) of the rows that
    hold each node (offsets ``vptr``), and the maximal elements of each row
    (offsets ``mptr``)."""
    K, nw = words.shape
    buf = np.empty(64 * nw, dtype=np.int64)
    cnt = np.zeros(n + 1, dtype=np.int64)
    mcnt = np.zeros(K + 1, dtype=np.int64)
    mbuf = np.empty(0, dtype=np.int64)  # each row's maximal nodes, row after row
    for r in range(K):
        m = _row_nodes(words, r, buf)
        c = mcnt[r]
        if mbuf.shape[0] < c + m:
            grown = np.empty(2 * (c + m), dtype=np.int64)
            grown[:c] = mbuf[:c]
            mbuf = grown
        for k in range(m):
            v = buf[k]
            cnt[v + 1] += 1
            if _maximal(words, sw, r, v, nw):
                mbuf[c] = v
                c += 1
        mcnt[r + 1] = c
    vptr = np.cumsum(cnt)
    vpos = np.empty(vptr[n], dtype=np.int64)
    fill = vptr[:n].copy()
    for p in range(K):
        for k in range(_row_nodes(words, order[p], buf)):
            v = buf[k]
            vpos[fill[v]] = p
            fill[v] += 1
    return vptr, vpos, mcnt, mbuf[:mcnt[K]].copy()
