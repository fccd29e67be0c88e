"""LeanKV's token tiers: Algorithm 1 and compaction, vectorized over rows, against a plain
Python model of the algorithm on random significance streams (hypothesis), with the memory
invariants after every step: each token in exactly one tier or pruned, the recent window
never demoted or pruned, pages per head equal to its tokens per tier rounded up, no page
leaked or freed twice. The properties fail on planted bugs."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st

import jkv.kv.allocator as alloc
import jkv.kv.token_tiers as tt
import jkv.policies.leankv as leankv

PAGE, SLOTS, LAYERS, HEADS = 4, 2, 1, 2
MAX_TOKENS = 96
WIDTH = MAX_TOKENS // PAGE + 1  # one spare column: a partial high and a partial low page
POOL = SLOTS * LAYERS * HEADS * WIDTH + 1


class Model:
    """Algorithm 1 over Python dicts for one (slot, layer, head): position -> score sum."""

    def __init__(self):
        self.high: dict[int, np.float32] = {}
        self.low: dict[int, np.float32] = {}
        self.pruned: set[int] = set()
        self.events: set[str] = set()  # which branches of the algorithm ran

    @staticmethod
    def mean(score, pos, n):
        return np.float32(score) / np.float32(max(n - pos, 1))

    def grow(self, n_prev, n, sig):
        """Tokens whose page filled join the high tier, every held token adds this step's
        significance."""
        for pos in range(n_prev // PAGE * PAGE, n // PAGE * PAGE):
            self.high[pos] = np.float32(0)
        for tier in (self.high, self.low):
            for pos in tier:
                tier[pos] = np.float32(tier[pos] + sig[pos])

    def place(self, n_prev, n, prompt, recent, a_high, a_low):
        """The tokens that left the window as the sequence grew from n_prev to n."""
        a_high, a_low = np.float32(a_high), np.float32(a_low)
        cands = sorted(p for p in self.high if n_prev - recent <= p < n - recent)
        if prompt:
            for p in cands:
                m, i = self.mean(self.high[p], p, n), np.float32(p + 1)
                if m >= a_high / i:
                    self.events.add("prompt high")
                    continue
                score = self.high.pop(p)
                if m >= a_low / i:
                    self.low[p] = score
                    self.events.add("prompt low")
                else:
                    self.pruned.add(p)
                    self.events.add("prompt pruned")
            return
        # generation: one candidate at a time, every mean as of n
        t_high, t_low = a_high / np.float32(n), a_low / np.float32(n)
        key = lambda tier: lambda p: (self.mean(tier[p], p, n), p)  # noqa: E731
        for c in cands:
            m = self.mean(self.high[c], c, n)
            if m >= t_high:
                old = {p: s for p, s in self.high.items() if p < n - recent and p not in cands}
                if not old:
                    continue
                v = min(old, key=key(old))
                mv = self.mean(old[v], v, n)
                if mv < t_low:
                    del self.high[v]
                    self.pruned.add(v)
                    self.events.add("high victim pruned")
                elif mv < t_high:
                    self.low[v] = self.high.pop(v)
                    self.events.add("high victim demoted")
            elif m >= t_low:
                self.low[c] = self.high.pop(c)
                v = min(self.low, key=key(self.low))
                if self.mean(self.low[v], v, n) < t_low:
                    del self.low[v]
                    self.pruned.add(v)
                    self.events.add("low victim pruned")
            else:
                del self.high[c]
                self.pruned.add(c)
                self.events.add("candidate pruned")


def tier_contents(meta, tables, counts):
    """Per row: ({pos: score} high, {pos: score} low) read back through the tables."""
    out = {}
    score, pos = np.asarray(meta.score).reshape(-1), np.asarray(meta.pos).reshape(-1)
    for is_low, count in ((False, counts.high), (True, counts.low)):
        addr, held = tt.slot_addresses(tables.pages, count, PAGE, is_low)
        addr, held = np.asarray(addr), np.asarray(held)
        for row in np.ndindex(held.shape[:-1]):
            a = addr[row][held[row]]
            out.setdefault(row, [None, None])[is_low] = dict(
                zip(pos[a].tolist(), score[a].tolist(), strict=True))
    return out


def check_memory(free, tables, counts, pool=POOL):
    pages = np.asarray(tables.pages)
    hp, lp = np.asarray(tables.num_pages), np.asarray(tables.low_pages)
    assert (hp == -(-np.asarray(counts.high) // PAGE)).all(), "high pages != tokens / page"
    assert (lp == -(-np.asarray(counts.low) // (2 * PAGE))).all(), "low pages != tokens / page"
    held = np.asarray(alloc.held_mask(tables))
    assert (pages[~held] == 0).all(), "an entry outside both sides holds a page"
    owned = pages[held]
    assert (owned > 0).all(), "the null page is never handed out"
    want = np.bincount(owned, minlength=pool)
    want[0] = 0
    refs = np.asarray(free.refs)
    assert (refs == want).all(), "reference counts differ from the references held"
    head, num_free = int(free.head), int(free.num_free)
    free_ids = np.asarray(free.ids)[(head + np.arange(num_free)) % (pool - 1)]
    assert len(set(free_ids.tolist())) == len(free_ids), "a page is free twice"
    assert (refs[free_ids] == 0).all(), "a referenced page is free"
    assert sorted(free_ids.tolist() + np.flatnonzero(refs).tolist()) == list(range(1, pool)), \
        "a page is neither free nor referenced (leaked)"


@jax.jit
def _step(free, tables, counts, meta, n_prev, n, sig):
    """The tokens whose page filled join the high tier, and every held token adds this
    step's significance (sig [S, L, H, MAX_TOKENS] by position)."""
    first = n_prev // PAGE * PAGE
    n_new = jnp.broadcast_to((n // PAGE * PAGE - first)[:, None, None], counts.high.shape)
    free, tables, counts, addr, ok1 = tt.grow_high(free, tables, counts, n_new, PAGE, MAX_TOKENS)
    new_pos = first[:, None, None, None] + jnp.arange(MAX_TOKENS)
    meta = tt.write_meta(meta, addr, new_pos, jnp.zeros(addr.shape))
    by_pos = lambda addr: jnp.take_along_axis(  # noqa: E731
        sig, jnp.clip(meta.pos.reshape(-1)[addr], 0, MAX_TOKENS - 1), -1)
    hi_addr, _ = tt.slot_addresses(tables.pages, counts.high, PAGE, False)
    lo_addr, _ = tt.slot_addresses(tables.pages, counts.low, PAGE, True)
    meta = tt.add_significance(meta, tables.pages, counts, PAGE, by_pos(hi_addr),
                               by_pos(lo_addr))
    return meta, free, tables, counts, ok1


@functools.cache
def _placement(*functions):
    """One placement (`leankv.place` or `place_generation`, `compact`, `move_tokens`) as one
    jitted call, as the engine runs it: run op by op, each `lax.cond` in `_lowest` compiled
    anew, it was most of this module's time. Keyed by the functions it calls, so a planted
    bug (`monkeypatch`) is traced in, never a cached trace of the real ones."""

    def placement(meta, free, tables, counts, placed, n, alphas, *, prompt, recent,
                  max_tokens, interval):
        where = dict(page=PAGE, recent=recent, alpha_high=alphas[0], alpha_low=alphas[1],
                     max_tokens=max_tokens)
        if prompt:
            fate_hi, fate_lo = leankv.place(meta, tables.pages, counts, placed, n, **where)
        else:
            fate_hi, fate_lo = leankv.place_generation(meta, tables.pages, counts, placed, n,
                                                       **where, max_moves=interval)
        free, tables, counts, moves, ok = tt.compact(free, tables, counts, fate_hi, fate_lo,
                                                     PAGE, 3 * PAGE if prompt else interval)
        return tt.move_tokens(meta, moves), free, tables, counts, ok

    return jax.jit(placement, static_argnames=("prompt", "recent", "max_tokens", "interval"))


def run(schedule, decode_steps, seed, recent, a_high, a_low, interval=1):
    """Prompt chunks, then decode steps placed every `interval` steps (and after the last)."""
    rng = np.random.default_rng(seed)
    heavy = rng.random((SLOTS, LAYERS, HEADS, MAX_TOKENS)) < 0.15
    fade = rng.integers(8, 64, heavy.shape)
    free = alloc.init_free(POOL, PAGE)
    tables = alloc.init_tables(SLOTS, LAYERS, HEADS, WIDTH)
    counts = tt.init_counts((SLOTS, LAYERS, HEADS))
    meta = tt.init_meta(POOL, PAGE)
    models = {row: Model() for row in np.ndindex(SLOTS, LAYERS, HEADS)}
    lengths = [0]
    for chunk in schedule:
        lengths.append(min(lengths[-1] + chunk, MAX_TOKENS // 2))
    prompt_steps = len(lengths) - 1
    for _ in range(decode_steps):
        lengths.append(min(lengths[-1] + 1, MAX_TOKENS))
    alphas = (jnp.float32(a_high), jnp.float32(a_low))
    placed = 0
    for step in range(len(lengths) - 1):
        n_prev, n = lengths[step], lengths[step + 1]
        prompt = step < prompt_steps
        # heavy-tailed attention around 1/n, and heavy hitters far above it that fade
        # once generation starts (so tokens kept high can later become victims)
        boost = np.where(heavy, 20.0 if prompt else 0.01, 1.0)
        boost *= np.where(n - np.arange(MAX_TOKENS) > fade, 0.01, 1.0)  # and tokens age
        sig = (rng.lognormal(0.0, 1.5, heavy.shape) * boost / (3 * n)).astype(np.float32)
        if n > n_prev:
            meta, free, tables, counts, ok = _step(
                free, tables, counts, meta, jnp.full((SLOTS,), n_prev), jnp.full((SLOTS,), n),
                jnp.asarray(sig))
            assert bool(ok)
            for row, model in models.items():
                model.grow(n_prev, n, sig[row])
        last = step == len(lengths) - 2
        if not prompt and n - placed < interval and not last:
            continue  # decode steps wait for the next placement
        place = _placement(leankv.place, leankv.place_generation, tt.compact, tt.unref,
                           tt.move_tokens)
        meta, free, tables, counts, ok = place(
            meta, free, tables, counts, jnp.int32(placed), jnp.int32(n), alphas,
            prompt=prompt, recent=recent, interval=interval,
            # odd seeds read only the slots a tier of MAX_TOKENS tokens reaches (the engine's)
            max_tokens=MAX_TOKENS if seed % 2 else None)
        assert bool(ok)
        got = tier_contents(meta, tables, counts)
        for row, model in models.items():
            model.place(placed, n, prompt, recent, a_high, a_low)
            high, low = got[row]
            assert high == pytest.approx(model.high), f"high tier of {row} after {n} tokens"
            assert low == pytest.approx(model.low), f"low tier of {row} after {n} tokens"
            in_pages = n // PAGE * PAGE
            every = sorted([*high, *low, *model.pruned])
            assert every == list(range(in_pages)), "a token is in two tiers or none"
            window = [p for p in [*low, *model.pruned] if p >= n - recent]
            assert not window, f"recent tokens {window} demoted or pruned"
        check_memory(free, tables, counts)
        placed = n
    return models


tier_runs = st.tuples(
    st.lists(st.integers(1, 3 * PAGE), min_size=1, max_size=5),  # prompt chunks
    st.integers(0, 24),  # decode steps
    st.integers(0, 2**31 - 1),  # significance seed
    st.sampled_from([PAGE, 2 * PAGE]),  # recent window
    st.sampled_from([0.5, 1.0, 3.0, 5.0]),  # alpha_high
    st.sampled_from([0.0, 0.1, 0.3, 1.0]),  # alpha_low
    st.sampled_from([1, 3, PAGE]),  # decode steps per placement
)


@settings(max_examples=25, deadline=None)
@given(tier_runs)
@example(([1], 4, 0, PAGE, 0.5, 1.0, 1))  # alpha_low above alpha_high
@example(([1], 6, 0, PAGE, 0.5, 1.0, 1))  # and a victim between the two thresholds
def test_tiers_follow_algorithm_1_and_keep_memory_exact(args):
    run(*args)


def test_a_long_run_uses_every_branch():
    """One fixed run long enough that tokens go to every tier by both phases (decode steps
    placed a page at a time)."""
    models = run([12, 12, 8], 56, seed=1, recent=PAGE, a_high=3.0, a_low=1.0, interval=PAGE)
    events = set().union(*(m.events for m in models.values()))
    assert events == {"prompt high", "prompt low", "prompt pruned", "high victim pruned",
                      "high victim demoted", "low victim pruned", "candidate pruned"}, events


def _leaky_unref(free, ids):
    """Planted bug: compaction forgets to give emptied pages back."""
    return free


def _double_free(free, ids):
    """Planted bug: pages are freed even if ids say nothing (every table page of the row)."""
    return alloc.unref(free, jnp.concatenate([ids.reshape(-1), ids.reshape(-1)]))


def _prune_the_window(meta, pages, counts, n_prev, n, **kw):
    """Planted bug: the candidates start one token inside the recent window."""
    kw["recent"] -= 1
    return _place(meta, pages, counts, n_prev, n, **kw)


_place = leankv.place


@pytest.mark.parametrize("module,name,bug,match", [
    (tt, "unref", _leaky_unref, "leaked|reference"),
    (tt, "unref", _double_free, "free twice|reference|referenced"),
    (leankv, "place", _prune_the_window, "demoted or pruned|tier"),
])
def test_the_properties_catch_planted_bugs(monkeypatch, module, name, bug, match):
    monkeypatch.setattr(module, name, bug)

    @settings(max_examples=60, deadline=None, database=None, phases=[Phase.generate])
    @given(tier_runs)
    def planted(args):
        run(*args)

    with pytest.raises(AssertionError, match=match):
        planted()


@pytest.mark.parametrize("why", ["pool", "width", "moves"])
def test_compaction_refuses_cleanly(why):
    """A demotion that needs a new low page from an empty pool, or a column the high side
    still holds, or a row losing more tokens than `max_moves`, changes nothing."""
    used = WIDTH if why == "width" else WIDTH - 1
    free = alloc.init_free(1 + used, PAGE)
    tables = alloc.init_tables(1, 1, 1, WIDTH)
    counts = tt.init_counts((1, 1, 1))
    full = WIDTH * PAGE
    free, tables, counts, _, ok = tt.grow_high(free, tables, counts,
                                               jnp.full((1, 1, 1), used * PAGE), PAGE, full)
    assert bool(ok) and int(free.num_free) == 0
    fate_hi = jnp.zeros((1, 1, 1, full), jnp.int32).at[..., 3].set(tt.LOW)
    if why == "moves":  # and a second token pruned: two leave the high tier
        fate_hi = fate_hi.at[..., 5].set(tt.PRUNE)
    fate_lo = jnp.zeros((1, 1, 1, 2 * full), jnp.int32)
    out = tt.compact(free, tables, counts, fate_hi, fate_lo, PAGE, 1)
    assert not bool(out[-1])
    for before, after in zip(jax.tree.leaves((free, tables, counts)),
                             jax.tree.leaves(out[:3]), strict=True):
        assert (np.asarray(before) == np.asarray(after)).all()
    assert all((np.asarray(m) == -1).all() for m in out[3])
    if why == "moves":  # with room for two moves it goes through
        out = tt.compact(free, tables, counts, fate_hi.at[..., 3].set(tt.PRUNE), fate_lo, PAGE,
                         2)
        assert bool(out[-1]) and int(out[2].high[0, 0, 0]) == used * PAGE - 2
        return
    # pruning the same token needs no page: it goes through
    out = tt.compact(free, tables, counts, fate_hi.at[..., 3].set(tt.PRUNE), fate_lo, PAGE, 1)
    assert bool(out[-1]) and int(out[2].high[0, 0, 0]) == used * PAGE - 1


# the data test's steps as one program each, as the engine runs them (op by op, its ~100
# programs compiled were most of its time)
_grow_high = jax.jit(tt.grow_high, static_argnums=(4, 5))
_write_tokens = jax.jit(tt.write_tokens, static_argnums=4)
_compact = jax.jit(tt.compact, static_argnums=(5, 6))
_move_pages = jax.jit(tt.move_pages, static_argnums=2)


@pytest.mark.parametrize("name", ["k8v4t"])
def test_token_data_follows_its_metadata(name):
    """Two rounds of random fates: after each compaction every high token's pages hold its
    own codes bit for bit, every low token the requantization of its high codes."""
    from jkv.kv.format import KVFormat
    from jkv.kv.pages import KVPages

    rng = np.random.default_rng()
    d, width = 64, 10
    fmt = KVFormat.parse(name)
    pool_pages = SLOTS * LAYERS * HEADS * width + 1
    pool = KVPages.zeros(pool_pages, PAGE, d, jnp.float32, fmt)
    free = alloc.init_free(pool_pages, PAGE)
    tables = alloc.init_tables(SLOTS, LAYERS, HEADS, width)
    counts = tt.init_counts((SLOTS, LAYERS, HEADS))
    meta = tt.init_meta(pool_pages, PAGE)
    n = 8 * PAGE - 3
    free, tables, counts, addr, ok = _grow_high(
        free, tables, counts, jnp.full((SLOTS, LAYERS, HEADS), n), PAGE, n)
    assert bool(ok)
    k = rng.normal(size=(SLOTS, LAYERS, HEADS, n, d)) * (1 + 5 * (rng.random(d) < 0.1))
    v = rng.normal(size=(SLOTS, LAYERS, HEADS, n, d))
    pool = _write_tokens(pool, addr, jnp.asarray(k, jnp.float32), jnp.asarray(v, jnp.float32),
                         PAGE)
    meta = tt.write_meta(meta, addr, jnp.arange(n), jnp.zeros(addr.shape))
    token = lambda x: x[..., None, :]  # noqa: E731
    high_want = KVPages.from_dense(token(jnp.asarray(k, jnp.float32)),
                                   token(jnp.asarray(v, jnp.float32)), fmt)
    low_want = KVPages.from_dense(*high_want.dense(), fmt.halved())
    low_pool = lambda p: p.as_format(fmt.halved())  # noqa: E731
    for _ in range(2):
        fate_hi = jnp.asarray(rng.choice([tt.KEEP, tt.LOW, tt.PRUNE], (SLOTS, LAYERS, HEADS,
                                                                        width * PAGE)))
        fate_lo = jnp.asarray(rng.choice([tt.KEEP, tt.PRUNE], (SLOTS, LAYERS, HEADS,
                                                             2 * width * PAGE)))
        free, tables, counts, moves, ok = _compact(free, tables, counts, fate_hi, fate_lo,
                                                   PAGE, 2 * width * PAGE)
        assert bool(ok)
        pool, meta = _move_pages(pool, moves, PAGE), tt.move_tokens(meta, moves)
        check_memory(free, tables, counts, pool_pages)
        for is_low, count, want, view in ((False, counts.high, high_want, lambda p: p),
                                          (True, counts.low, low_want, low_pool)):
            addr, held = tt.slot_addresses(tables.pages, count, PAGE, is_low)
            addr, held = np.asarray(addr), np.asarray(held)
            pos = np.asarray(meta.pos).reshape(-1)[addr]
            got = view(pool).take_tokens(jnp.asarray(addr // (2 * PAGE)),
                                         jnp.asarray(addr % (2 * PAGE)))
            for row in np.ndindex(held.shape[:-1]):
                for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
                    a, b = np.asarray(a)[row][held[row]], np.asarray(b)[row][pos[row][held[row]]]
                    np.testing.assert_array_equal(a, b, err_msg=f"{row} low={is_low}")
        assert int(np.asarray(counts.low).sum()) > 0


@pytest.mark.parametrize("k", [1, 4, 5, 16, 40])
def test_first_and_lowest_against_numpy(k):
    """The selections compaction and placement build on, on random rows (ties, empty and
    full rows, k above the row length): `_first` gives the first k set indices in order,
    padded with -1; `_lowest` marks the `count` (<= k) lowest means among a set, ties to
    the earliest position, all of the set when it has fewer."""
    rng = np.random.default_rng(k)
    r, c = 64, 24
    mask = rng.random((r, c)) < rng.choice([0.0, 0.2, 0.7, 1.0], size=(r, 1))
    got = np.asarray(tt._first(jnp.asarray(mask), k))
    for row, m in zip(got, mask, strict=True):
        want = np.flatnonzero(m)[:k]
        np.testing.assert_array_equal(row, np.pad(want, (0, k - len(want)), constant_values=-1))

    pos = np.stack([rng.permutation(1000)[:c] for _ in range(r)]).astype(np.int32)
    kk = min(k, c)
    count = rng.integers(-1, kk + 1, r).astype(np.int32)  # its contract: at most k
    # few values (many ties, broken by position) and distinct ones (no tie to break)
    for mean in (rng.integers(0, 4, (r, c)).astype(np.float32),
                 rng.permutation(r * c).reshape(r, c).astype(np.float32)):
        got = np.asarray(leankv._lowest(jnp.asarray(mean), jnp.asarray(pos), jnp.asarray(mask),
                                    jnp.asarray(count), kk))
        for i in range(r):
            order = sorted(np.flatnonzero(mask[i]), key=lambda j: (mean[i, j], pos[i, j]))
            want = np.zeros(c, bool)
            want[order[:max(0, min(count[i], kk))]] = True
            np.testing.assert_array_equal(got[i], want, err_msg=f"row {i}")
