"""KVCacheManager: block pool, block tables, prefix cache, ref counts, LRU eviction.

A Hypothesis state machine drives the manager the way the Scheduler and the engine do
(prefix lookup, allocate, compute, cache, sample, preempt, finish) and keeps its own
model of what every KV slot holds. A slot written at position p of a sequence holds
"the K/V of tokens[:p+1]" (K/V depends on the whole prefix), so the central check is that
every computed position of every live sequence, and every block reachable through the
prefix cache, holds exactly the K/V its tokens call for: a prefix hit must never change
what a sequence sees. Plain unit tests pin down the documented behaviours, and a small
end-to-end run goes through the real Scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from llmopt.runtime.kv_cache_manager import KVCacheManager, hash_block
from llmopt.runtime.sampling_params import SamplingParams
from llmopt.runtime.scheduler import Scheduler
from llmopt.runtime.sequence import Sequence, SequenceStatus

ALPHABET = [0, 1, 2]  # few token ids, so prefixes (and whole blocks) collide often
MAX_LIVE = 6
MAX_TOKENS_PER_SEQ = 24
BUDGETS = st.integers(0, 11).map(lambda x: 12 - x)  # favours whole prompts over tiny chunks


def make_seq(request_id: str, tokens: list[int], max_tokens: int = 16) -> Sequence:
    return Sequence(
        request_id=request_id,
        prompt_token_ids=list(tokens),
        params=SamplingParams(max_tokens=max_tokens),
        arrival_time=0.0,
    )


def snapshot(kv: KVCacheManager, seq: Sequence | None = None) -> tuple:
    """Everything an allocation could change."""
    state = (
        [(b.block_id, b.ref_cnt, b.block_hash) for b in kv.blocks],
        list(kv.free_queue),
        dict(kv.cached_blocks),
        kv.prefix_cache_queries,
        kv.prefix_cache_hits,
        kv.peak_used_blocks,
    )
    if seq is not None:
        state += (list(seq.block_table), seq.num_cached_blocks, seq.num_computed_tokens, list(seq.token_ids))
    return state


def check_pool_invariants(kv: KVCacheManager, tables: list[list[int]]) -> None:
    """Ref counts, free queue and prefix-cache index agree with the live block tables."""
    refs = [0] * kv.num_blocks
    for table in tables:
        assert len(table) == len(set(table)), f"a block appears twice in one block table: {table}"
        for b in table:
            refs[b] += 1
    for block in kv.blocks:
        assert block.ref_cnt >= 0, f"block {block.block_id} has a negative ref count"
        assert block.ref_cnt == refs[block.block_id], (
            f"block {block.block_id}: ref_cnt {block.ref_cnt} but in {refs[block.block_id]} live tables"
        )
        assert (block.block_id in kv.free_queue) == (block.ref_cnt == 0), f"block {block.block_id} free-queue mismatch"
    assert len(kv.free_queue) == len(set(kv.free_queue))
    assert kv.num_free_blocks + sum(1 for b in kv.blocks if b.ref_cnt > 0) == kv.num_blocks
    assert kv.num_used_blocks == kv.num_blocks - kv.num_free_blocks
    assert kv.peak_used_blocks >= kv.num_used_blocks
    # cached_blocks and the blocks' own hashes are one bijection
    for block_hash, block_id in kv.cached_blocks.items():
        assert kv.blocks[block_id].block_hash == block_hash
    hashed = [b for b in kv.blocks if b.block_hash is not None]
    assert len(hashed) == len(kv.cached_blocks)
    for b in hashed:
        assert kv.cached_blocks.get(b.block_hash) == b.block_id
    if not kv.enable_prefix_caching:
        assert kv.cached_blocks == {} and not hashed
        assert kv.prefix_cache_hits == 0


@dataclass(eq=False)
class Entry:
    seq: Sequence
    running: bool = False
    pending: int = 0  # tokens allocated but not computed yet (scheduled for the current step)
    admitted: int = 0  # when it last started running: the newest running one is preempted first

    def __repr__(self) -> str:  # short, for Hypothesis' failure reports
        seq = self.seq
        return (
            f"Entry({seq.request_id}, tokens={seq.token_ids}, "
            f"computed={seq.num_computed_tokens}, table={seq.block_table})"
        )


class KVCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv: KVCacheManager | None = None
        self.live: list[Entry] = []
        self.history: list[list[int]] = []  # every token list ever seen, for forks
        self.next_id = 0
        # model of the KV memory: content[block][slot] = the token prefix whose K/V is there
        self.content: list[list[tuple[int, ...] | None]] = []
        self.hash_prefix: dict[bytes, tuple[int, ...]] = {}  # chained hash -> the tokens it names
        self.queries = 0
        self.hits = 0
        self.clock = 0
        self.free_order: list[int] = []  # model of the LRU free queue

    # ---- helpers ------------------------------------------------------------------
    @property
    def bs(self) -> int:
        return self.kv.block_size

    def record_hashes(self, tokens: list[int]) -> list[bytes]:
        """The hash chain of `tokens`' full blocks; also checks no two prefixes share a hash."""
        chain: list[bytes] = []
        parent = None
        for i in range(len(tokens) // self.bs):
            parent = hash_block(parent, tokens[i * self.bs : (i + 1) * self.bs])
            prefix = tuple(tokens[: (i + 1) * self.bs])
            assert self.hash_prefix.setdefault(parent, prefix) == prefix, "two different prefixes share a hash"
            chain.append(parent)
        return chain

    def pick(self, data, pred) -> Entry | None:
        """A live sequence satisfying `pred`, or None (the rule then does nothing)."""
        candidates = [e for e in self.live if pred(e)]
        return data.draw(st.sampled_from(candidates)) if candidates else None

    def note_new_blocks(self, new_blocks: list[int], hits: list[int]) -> None:
        """Revived hits leave the free queue; fresh blocks come off its front (least recently freed)."""
        self.free_order = [b for b in self.free_order if b not in hits]
        expected = self.free_order[: len(new_blocks)]
        assert new_blocks == expected, f"fresh blocks {new_blocks} are not the LRU head {expected}"
        del self.free_order[: len(new_blocks)]
        for b in new_blocks:
            self.content[b] = [None] * self.bs  # nothing usable in them until computed

    def release(self, seq: Sequence) -> None:
        """kv.free, with the model's free queue: tail blocks first, each once its last user is gone; a
        block that caches nothing goes to the front (reused first), a cached one to the back (LRU)."""
        table = list(seq.block_table)
        self.kv.free(seq)
        assert seq.block_table == [] and seq.num_cached_blocks == 0
        for b in reversed(table):
            if self.kv.blocks[b].ref_cnt == 0:
                if self.kv.blocks[b].block_hash is None:
                    self.free_order.insert(0, b)
                else:
                    self.free_order.append(b)

    def allocate(self, entry: Entry, num_new: int, hits: list[int] | None = None) -> bool:
        kv, seq = self.kv, entry.seq
        before = snapshot(kv, seq)
        old_len = len(seq.block_table)
        evictable = {b.block_id for b in kv.blocks if b.ref_cnt == 0 and b.block_hash is not None}
        ok = kv.allocate_slots(seq, num_new, hits)
        if not ok:
            event("allocation failed")
            assert snapshot(kv, seq) == before, "a failed allocation changed state"
            return False
        hits = hits or []
        assert seq.block_table[:old_len] == before[6][:old_len]
        assert seq.block_table[old_len : old_len + len(hits)] == hits
        new_blocks = seq.block_table[old_len + len(hits) :]
        self.note_new_blocks(new_blocks, hits)
        if evictable & set(new_blocks):
            event("cached block evicted")
        if evictable & set(hits):
            event("free cached block revived")
        num_computed = seq.num_computed_tokens + len(hits) * self.bs
        assert len(seq.block_table) == kv.blocks_needed(num_computed + num_new)
        return True

    def new_sequence(self, tokens: list[int]) -> None:
        tokens = tokens[: MAX_TOKENS_PER_SEQ - 4] or [0]
        self.next_id += 1
        self.history.append(list(tokens))
        self.live.append(Entry(make_seq(f"r{self.next_id}", tokens)))

    def admit(self, entry: Entry, budget: int) -> int:
        """Scheduler step 2 for one new or preempted sequence; tokens scheduled (0: did not fit)."""
        kv, seq = self.kv, entry.seq
        assert not entry.running and seq.block_table == [] and seq.num_computed_tokens == 0
        hits = kv.get_computed_blocks(seq)
        # a lookup counts only once the request is admitted (see below)
        assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (self.queries, self.hits)
        # the hits are the longest cached prefix of the hash chain, never the last token
        chain = self.record_hashes(seq.token_ids)
        max_blocks = (seq.num_tokens - 1) // self.bs
        if not kv.enable_prefix_caching:
            assert hits == []
        else:
            assert len(hits) <= max_blocks
            assert hits == [kv.cached_blocks[h] for h in chain[: len(hits)]]
            assert len(hits) == max_blocks or chain[len(hits)] not in kv.cached_blocks
        assert len(set(hits)) == len(hits)
        if hits:
            event("prefix hit" + (" after preemption" if seq.num_preemptions else ""))
        # what a hit serves is exactly the K/V of this sequence's own prefix
        for i, b in enumerate(hits):
            for s in range(self.bs):
                p = i * self.bs + s
                assert self.content[b][s] == tuple(seq.token_ids[: p + 1]), "a prefix hit serves the wrong K/V"
        num_computed = len(hits) * self.bs
        num_new = min(seq.num_tokens - num_computed, budget)
        assert num_new >= 1
        if not self.allocate(entry, num_new, hits):
            return 0  # not counted: the lookup is repeated next time
        kv.record_prefix_lookup(seq.num_tokens, num_computed)
        if kv.enable_prefix_caching:
            self.queries += seq.num_tokens
            self.hits += num_computed
        seq.num_computed_tokens = num_computed
        entry.running = True
        entry.pending = num_new
        self.clock += 1
        entry.admitted = self.clock
        return num_new

    def extend(self, entry: Entry, budget: int) -> int:
        """Scheduler step 1 for one running sequence: more of a chunked prompt, or a decode."""
        seq = entry.seq
        assert entry.running and entry.pending == 0 and seq.num_computed_tokens < seq.num_tokens
        num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
        if not self.allocate(entry, num_new):
            return 0
        entry.pending = num_new
        return num_new

    def preempt_entry(self, entry: Entry) -> None:
        self.release(entry.seq)
        entry.seq.num_computed_tokens = 0
        entry.seq.num_preemptions += 1
        entry.running = False
        entry.pending = 0
        event("preempted")

    def finish_entry(self, entry: Entry) -> None:
        self.release(entry.seq)
        self.live.remove(entry)

    @staticmethod
    def behind(e: Entry) -> bool:
        return e.running and e.pending == 0 and e.seq.num_computed_tokens < e.seq.num_tokens

    @staticmethod
    def caught_up(e: Entry) -> bool:
        return e.running and e.pending == 0 and e.seq.num_computed_tokens == e.seq.num_tokens < MAX_TOKENS_PER_SEQ

    # ---- rules --------------------------------------------------------------------
    @initialize(
        # the first value of each is the one Hypothesis favours (and shrinks to): roomy, cached
        num_blocks=st.integers(0, 20).map(lambda x: 24 - x),
        block_size=st.sampled_from([2, 1, 3, 4]),
        prefix_caching=st.sampled_from([True, False]),
        prompt=st.lists(st.sampled_from(ALPHABET), min_size=1, max_size=12),
        forks=st.lists(
            st.tuples(st.integers(0, 12).map(lambda x: 12 - x), st.lists(st.sampled_from(ALPHABET), max_size=4)),
            min_size=1,
            max_size=3,
        ),
    )
    def setup(self, num_blocks, block_size, prefix_caching, prompt, forks):
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
        self.content = [[None] * block_size for _ in range(num_blocks)]
        self.free_order = list(range(num_blocks))
        self.new_sequence(prompt)
        # warm the cache: the first prompt is computed and cached, the forks of it are waiting
        if self.admit(self.live[0], MAX_TOKENS_PER_SEQ):
            self.compute([self.live[0]])
        for keep, extra in forks:
            self.new_sequence(prompt[:keep] + extra)

    @rule()
    def engine_step(self):
        """A whole engine step, the way engine.step and Scheduler.schedule do it.

        Compute what is scheduled, if anything; else sample a token for every sequence that
        caught up (a long one finishes and comes back as a follow-up turn: its tokens plus a
        new one), then schedule: running sequences oldest first, preempting the newest when
        the pool is short, then waiting ones in order while nothing was preempted.
        """
        pending = [e for e in self.live if e.pending]
        if pending:  # all scheduled sequences together (the same content may be computed twice)
            self.compute(pending)
            return
        for e in list(self.live):
            seq = e.seq
            if e.running and seq.num_computed_tokens == seq.num_tokens:
                if seq.num_tokens >= min(MAX_TOKENS_PER_SEQ, seq.num_prompt_tokens + 5):
                    self.finish_entry(e)
                    self.new_sequence(seq.token_ids + [self.next_id % len(ALPHABET)])
                else:
                    seq.token_ids.append((self.next_id + seq.num_tokens) % len(ALPHABET))
                    self.history.append(list(seq.token_ids))
        budget = 8
        running = sorted((e for e in self.live if e.running), key=lambda e: e.admitted)
        preempted = False
        i = 0
        while i < len(running) and budget:
            e = running[i]
            if not self.behind(e):
                i += 1
                continue
            scheduled = self.extend(e, budget)
            if scheduled:
                budget -= scheduled
                i += 1
                continue
            victim = running.pop()
            self.preempt_entry(victim)
            preempted = True
            if victim is e:
                break
        for e in self.live:
            if preempted or not budget:
                break
            if not e.running:
                scheduled = self.admit(e, budget)
                if not scheduled:
                    break
                budget -= scheduled

    @rule(data=st.data())
    def add_sequence(self, data):
        if len(self.live) >= MAX_LIVE:
            return
        if data.draw(st.booleans(), label="fork"):
            parent = data.draw(st.sampled_from(self.history), label="parent")
            keep = data.draw(st.integers(0, len(parent)), label="keep")
            tokens = parent[:keep] + data.draw(st.lists(st.sampled_from(ALPHABET), max_size=6), label="extra")
        else:
            tokens = data.draw(st.lists(st.sampled_from(ALPHABET), min_size=1, max_size=12), label="prompt")
        self.new_sequence(tokens)

    @rule(data=st.data(), budget=BUDGETS)
    def schedule_waiting(self, data, budget):
        entry = self.pick(data, lambda e: not e.running)
        if entry is not None:
            self.admit(entry, budget)

    @rule(data=st.data(), budget=BUDGETS)
    def schedule_running(self, data, budget):
        entry = self.pick(data, self.behind)
        if entry is not None:
            self.extend(entry, budget)

    def compute(self, entries: list[Entry]) -> None:
        # the model writes K/V for every scheduled position, then each sequence advances and caches
        for entry in entries:
            seq = entry.seq
            for p in range(seq.num_computed_tokens, seq.num_computed_tokens + entry.pending):
                block = self.kv.blocks[seq.block_table[p // self.bs]]
                assert block.ref_cnt == 1, f"writing into shared block {block.block_id}"
                assert block.block_hash is None, f"writing into cached block {block.block_id}"
                self.content[block.block_id][p % self.bs] = tuple(seq.token_ids[: p + 1])
        for entry in entries:
            seq = entry.seq
            seq.num_computed_tokens += entry.pending
            entry.pending = 0
            self.record_hashes(seq.token_ids)
            self.kv.cache_full_blocks(seq)
            assert seq.num_cached_blocks <= len(seq.block_table)

    @rule(data=st.data())
    def compute_one(self, data):
        entry = self.pick(data, lambda e: e.pending > 0)
        if entry is not None:
            self.compute([entry])

    @rule(data=st.data(), token=st.sampled_from(ALPHABET))
    def sample_token(self, data, token):
        entry = self.pick(data, self.caught_up)
        if entry is None:
            return
        entry.seq.token_ids.append(token)
        self.history.append(list(entry.seq.token_ids))

    @rule(data=st.data(), token=st.sampled_from(ALPHABET))
    def decode(self, data, token):
        """allocate_slots(seq, 1), compute, cache_full_blocks, then sample the next token."""
        entry = self.pick(data, lambda e: self.behind(e) and e.seq.num_computed_tokens == e.seq.num_tokens - 1)
        if entry is None:
            return
        if not self.allocate(entry, 1):
            return
        entry.pending = 1
        self.compute([entry])
        if entry.seq.num_tokens < MAX_TOKENS_PER_SEQ:
            entry.seq.token_ids.append(token)

    @rule(data=st.data())
    def finish(self, data):
        """Finished or aborted, waiting or running."""
        entry = self.pick(data, lambda e: True)
        if entry is not None:
            self.finish_entry(entry)

    @rule(data=st.data())
    def preempt(self, data):
        entry = self.pick(data, lambda e: e.running)
        if entry is not None:
            self.preempt_entry(entry)

    @rule(really=st.integers(0, 3))
    def reset_prefix_cache(self, really):
        if really != 3:  # rarely: it throws the whole cache away
            return
        in_use = {h for h, b in self.kv.cached_blocks.items() if self.kv.blocks[b].ref_cnt > 0}
        self.kv.reset_prefix_cache()
        assert set(self.kv.cached_blocks) == in_use

    # ---- invariants ---------------------------------------------------------------
    @invariant()
    def pool_is_consistent(self):
        if self.kv is None:
            return
        check_pool_invariants(self.kv, [e.seq.block_table for e in self.live])
        assert list(self.kv.free_queue) == self.free_order, "free queue is not in least-recently-freed order"
        assert (self.kv.prefix_cache_queries, self.kv.prefix_cache_hits) == (self.queries, self.hits)

    @invariant()
    def cached_blocks_hold_their_prefix(self):
        if self.kv is None:
            return
        for block_hash, block_id in self.kv.cached_blocks.items():
            prefix = self.hash_prefix[block_hash]
            start = len(prefix) - self.bs
            for s in range(self.bs):
                assert self.content[block_id][s] == prefix[: start + s + 1], f"cached block {block_id} holds other K/V"

    @invariant()
    def sequences_see_their_own_kv(self):
        if self.kv is None:
            return
        for entry in self.live:
            seq = entry.seq
            if not entry.running:
                assert seq.block_table == [] and seq.num_computed_tokens == 0 and entry.pending == 0
                continue
            assert len(seq.block_table) == self.kv.blocks_needed(seq.num_computed_tokens + entry.pending)
            assert seq.num_computed_tokens + entry.pending <= seq.num_tokens
            assert seq.num_cached_blocks <= len(seq.block_table)
            chain = self.record_hashes(seq.token_ids)
            for i, b in enumerate(seq.block_table):
                block_hash = self.kv.blocks[b].block_hash
                assert block_hash is None or (i < len(chain) and block_hash == chain[i]), "block mislabeled"
            for p in range(seq.num_computed_tokens):
                b = seq.block_table[p // self.bs]
                assert self.content[b][p % self.bs] == tuple(seq.token_ids[: p + 1]), (
                    f"{seq.request_id} position {p} reads the wrong K/V from block {b}"
                )

    def teardown(self):
        if self.kv is None:
            return
        for entry in reversed(self.live):
            self.release(entry.seq)
        self.live = []
        assert list(self.kv.free_queue) == self.free_order
        assert self.kv.num_free_blocks == self.kv.num_blocks
        assert all(b.ref_cnt == 0 for b in self.kv.blocks)
        check_pool_invariants(self.kv, [])


KVCacheMachine.TestCase.settings = settings(
    max_examples=250,
    stateful_step_count=50,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestKVCacheMachine = KVCacheMachine.TestCase


# ---- unit tests ------------------------------------------------------------------------
def prefill(kv: KVCacheManager, seq: Sequence) -> list[int]:
    """Schedule a waiting sequence's whole prompt at once and compute it; returns the hits."""
    hits = kv.get_computed_blocks(seq)
    num_computed = len(hits) * kv.block_size
    assert kv.allocate_slots(seq, seq.num_tokens - num_computed, hits)
    kv.record_prefix_lookup(seq.num_tokens, num_computed)
    seq.num_computed_tokens = seq.num_tokens
    kv.cache_full_blocks(seq)
    return hits


def decode_one(kv: KVCacheManager, seq: Sequence, token: int) -> None:
    seq.token_ids.append(token)
    assert kv.allocate_slots(seq, 1)
    seq.num_computed_tokens += 1
    kv.cache_full_blocks(seq)


def test_identical_prompts_share_blocks():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    prompt = list(range(10))  # 2 full blocks + 2 tokens
    a, b = make_seq("a", prompt), make_seq("b", prompt)
    assert prefill(kv, a) == []
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (10, 0)
    hits = prefill(kv, b)
    assert hits == a.block_table[:2]
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert [kv.blocks[x].ref_cnt for x in a.block_table] == [2, 2, 1]
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (20, 8)
    assert kv.num_used_blocks == 4
    kv.free(a)
    assert [kv.blocks[x].ref_cnt for x in b.block_table] == [1, 1, 1]
    kv.free(b)
    assert kv.num_free_blocks == 10


def test_last_token_is_never_served_from_cache():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    prompt = list(range(12))  # exactly 3 full blocks
    a = make_seq("a", prompt)
    prefill(kv, a)
    assert len(kv.cached_blocks) == 3
    b = make_seq("b", prompt)
    hits = kv.get_computed_blocks(b)
    assert hits == a.block_table[:2]  # k - 1 blocks: the last token must be recomputed for its logits
    assert kv.allocate_slots(b, 12 - 8, hits)
    assert len(b.block_table) == 3 and b.block_table[2] != a.block_table[2]
    # a one-token prompt never hits
    c, d = make_seq("c", [7]), make_seq("d", [7])
    kv2 = KVCacheManager(num_blocks=4, block_size=1)
    prefill(kv2, c)
    assert kv2.get_computed_blocks(d) == []


def test_lru_eviction_order():
    kv = KVCacheManager(num_blocks=7, block_size=2)
    a, b = make_seq("a", [1, 1, 2, 2, 3, 3, 9]), make_seq("b", [4, 4, 5, 5, 9])
    prefill(kv, a)  # blocks 0, 1, 2 full and cached, 3 partial
    prefill(kv, b)  # blocks 4, 5 full and cached, 6 partial
    assert a.block_table == [0, 1, 2, 3] and b.block_table == [4, 5, 6]
    kv.free(a)  # freed first, tail blocks before head blocks
    kv.free(b)
    # the partial blocks cache nothing: they go to the front, to be reused before any cached block
    assert list(kv.free_queue) == [6, 3, 2, 1, 0, 5, 4]
    assert set(kv.cached_blocks.values()) == {0, 1, 2, 4, 5}
    # allocating fresh blocks takes those first: no cached block is evicted
    c = make_seq("c", [8, 8, 8])
    assert prefill(kv, c) == []
    assert c.block_table == [6, 3]
    assert set(kv.cached_blocks.values()) == {0, 1, 2, 4, 5, 6}  # block 6 now caches c's first block
    # all of a's full blocks are still a prefix hit; reviving them takes them out of the queue
    a2 = make_seq("a2", [1, 1, 2, 2, 3, 3, 9])
    hits = kv.get_computed_blocks(a2)
    assert hits == [0, 1, 2]
    assert kv.allocate_slots(a2, 1, hits)
    assert a2.block_table == [0, 1, 2, 5]  # then the least recently freed cached block: b's tail
    assert set(kv.cached_blocks.values()) == {0, 1, 2, 4, 6}
    assert list(kv.free_queue) == [4]
    b2 = make_seq("b2", [4, 4, 0])
    assert kv.get_computed_blocks(b2) == [4]  # b's head block survived


def test_recently_used_blocks_are_evicted_last():
    kv = KVCacheManager(num_blocks=4, block_size=1)
    a, b = make_seq("a", [1, 2]), make_seq("b", [3, 4])
    prefill(kv, a)
    prefill(kv, b)
    kv.free(a)
    kv.free(b)
    assert list(kv.free_queue) == [1, 0, 3, 2]
    a2 = make_seq("a2", [1, 5])  # re-uses a's head block: it becomes most recently freed afterwards
    assert prefill(kv, a2) == [0]
    kv.free(a2)
    assert list(kv.free_queue)[-2:] == [1, 0]


def test_failed_allocation_changes_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = make_seq("a", [1, 2, 3, 4, 5])
    prefill(kv, a)  # 3 blocks, 2 cached
    kv.free(a)
    b = make_seq("b", [1, 2, 3, 4, 7, 7, 7, 7, 7])  # 2 hits (both free) + needs 3 more: only 2 left
    hits = kv.get_computed_blocks(b)
    assert len(hits) == 2
    before = snapshot(kv, b)
    assert kv.allocate_slots(b, b.num_tokens - 4, hits) is False
    assert snapshot(kv, b) == before
    # a running sequence that cannot grow
    c = make_seq("c", [1, 2, 3, 4, 5, 6, 7, 8])
    prefill(kv, c)
    assert kv.num_free_blocks == 0
    c.token_ids.append(9)
    before = snapshot(kv, c)
    assert kv.allocate_slots(c, 1) is False
    assert snapshot(kv, c) == before
    kv.free(c)
    assert kv.num_free_blocks == 4


def test_revived_hits_do_not_count_as_free():
    # every free block is a cached hit: reviving them leaves nothing for the new tokens
    kv = KVCacheManager(num_blocks=2, block_size=2)
    a = make_seq("a", [1, 2, 3, 4, 5])
    hits = kv.get_computed_blocks(a)
    assert kv.allocate_slots(a, 4, hits)
    a.num_computed_tokens = 4
    kv.cache_full_blocks(a)
    kv.free(a)
    b = make_seq("b", [1, 2, 3, 4, 5])
    hits = kv.get_computed_blocks(b)
    assert hits == [0, 1]
    before = snapshot(kv, b)
    assert kv.allocate_slots(b, 1, hits) is False
    assert snapshot(kv, b) == before


def test_no_hits_without_prefix_caching():
    kv = KVCacheManager(num_blocks=12, block_size=2, enable_prefix_caching=False)
    prompt = [1, 2, 3, 4, 5, 6, 7]
    a, b = make_seq("a", prompt), make_seq("b", prompt)
    assert prefill(kv, a) == []
    assert prefill(kv, b) == []
    assert set(a.block_table).isdisjoint(b.block_table)
    assert kv.cached_blocks == {} and all(blk.block_hash is None for blk in kv.blocks)
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (0, 0)
    kv.free(a)
    c = make_seq("c", prompt)
    assert prefill(kv, c) == []


def test_same_content_computed_twice_keeps_first_copy():
    kv = KVCacheManager(num_blocks=8, block_size=2)
    a, b = make_seq("a", [1, 2, 3]), make_seq("b", [1, 2, 4])
    for s in (a, b):  # both scheduled in the same step: neither sees the other's blocks
        assert kv.get_computed_blocks(s) == []
        assert kv.allocate_slots(s, 3, [])
    for s in (a, b):
        s.num_computed_tokens = 3
        kv.cache_full_blocks(s)
    assert kv.cached_blocks == {a.block_hashes[0]: a.block_table[0]}
    assert kv.blocks[b.block_table[0]].block_hash is None
    kv.free(a)
    kv.free(b)
    check_pool_invariants(kv, [])


def test_lookup_stops_at_the_first_missing_block():
    # A and B compute the same first block in one step: B's copy is registered, A's is not,
    # while A's second block is. Once B's copy is evicted the chain has a hole at block 0,
    # and a lookup must stop there instead of serving A's block 1 as block 0.
    kv = KVCacheManager(num_blocks=6, block_size=2)
    a, b = make_seq("a", [1, 2, 3, 4, 5]), make_seq("b", [1, 2, 9])
    assert kv.allocate_slots(a, 5, kv.get_computed_blocks(a))
    assert kv.allocate_slots(b, 3, kv.get_computed_blocks(b))
    for s in (b, a):
        s.num_computed_tokens = s.num_tokens
        kv.cache_full_blocks(s)
    assert kv.cached_blocks[a.block_hashes[0]] == b.block_table[0]
    assert kv.cached_blocks[a.block_hashes[1]] == a.block_table[1]
    kv.free(b)
    d = make_seq("d", [7, 7, 7, 7, 7])
    assert kv.allocate_slots(d, 5, kv.get_computed_blocks(d))  # evicts B's blocks
    assert a.block_hashes[0] not in kv.cached_blocks and a.block_hashes[1] in kv.cached_blocks
    c = make_seq("c", [1, 2, 3, 4, 5])
    assert kv.get_computed_blocks(c) == []


def test_partially_computed_prompt_is_cached_once_full():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_seq("a", list(range(9)))
    assert kv.allocate_slots(a, 4, kv.get_computed_blocks(a))  # chunk of exactly one block
    a.num_computed_tokens = 4
    kv.cache_full_blocks(a)
    assert list(kv.cached_blocks.values()) == [a.block_table[0]]
    assert kv.allocate_slots(a, 5)
    a.num_computed_tokens = 9
    kv.cache_full_blocks(a)
    assert set(kv.cached_blocks.values()) == set(a.block_table[:2])


# ---- regressions: a partially computed last block must be registered once it fills
# (blocks filled by decoding, or by prompt chunks that are not block-aligned)
def test_blocks_filled_by_decoding_are_cached():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_seq("a", [1, 2, 3, 4])
    prefill(kv, a)
    for t in (5, 6, 7, 8):
        decode_one(kv, a, t)
    assert a.num_computed_tokens == 8
    b = make_seq("b", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert kv.get_computed_blocks(b) == a.block_table[:2]


def test_chunked_prefill_blocks_are_cached():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_seq("a", list(range(10)))
    assert kv.allocate_slots(a, 3, kv.get_computed_blocks(a))
    a.num_computed_tokens = 3
    kv.cache_full_blocks(a)
    while a.num_computed_tokens < a.num_tokens:
        n = min(3, a.num_tokens - a.num_computed_tokens)
        assert kv.allocate_slots(a, n)
        a.num_computed_tokens += n
        kv.cache_full_blocks(a)
    assert set(kv.cached_blocks.values()) == set(a.block_table[:2])


# ---- end to end through the real Scheduler ---------------------------------------------
def fake_next_token(kv: KVCacheManager, content, seq: Sequence) -> int:
    """A 'model' that reads its context from the KV blocks, so a wrong hit changes its output."""
    ctx = []
    for p in range(seq.num_computed_tokens):
        slot = content[seq.block_table[p // kv.block_size]][p % kv.block_size]
        assert slot == tuple(seq.token_ids[: p + 1]), f"{seq.request_id} reads wrong K/V at {p}"
        ctx.append(slot[-1])
    return (sum(ctx) * 7 + len(ctx)) % 3


def run_engine(prompts, max_tokens, num_blocks, block_size, budget, max_num_seqs, prefix_caching):
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
    sched = Scheduler(kv, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)
    content = [[None] * block_size for _ in range(num_blocks)]
    seqs = [make_seq(f"r{i}", p, max_tokens) for i, p in enumerate(prompts)]
    for s in seqs:
        sched.add(s)
    for _ in range(2000):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        check_pool_invariants(kv, [s.block_table for s in sched.running])
        assert all(s.block_table == [] and s.num_computed_tokens == 0 for s in sched.waiting)
        for seq, n in out.scheduled:
            assert seq.status is SequenceStatus.RUNNING
            assert len(seq.block_table) == kv.blocks_needed(seq.num_computed_tokens + n)
            for p in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
                b = seq.block_table[p // block_size]
                assert kv.blocks[b].ref_cnt == 1 and kv.blocks[b].block_hash is None
                content[b][p % block_size] = tuple(seq.token_ids[: p + 1])
        for seq, n in out.scheduled:
            seq.num_computed_tokens += n
            kv.cache_full_blocks(seq)
        for seq, n in out.scheduled:
            if seq.num_computed_tokens == seq.num_tokens:
                seq.token_ids.append(fake_next_token(kv, content, seq))
                if seq.num_output_tokens >= max_tokens:
                    sched.finish(seq)
        check_pool_invariants(kv, [s.block_table for s in sched.running])
        if prefix_caching:
            assert 0 <= kv.prefix_cache_hits <= kv.prefix_cache_queries
    assert not sched.has_unfinished(), "the scheduler stopped making progress"
    assert kv.num_free_blocks == num_blocks
    return [s.output_token_ids for s in seqs], sched.num_preemptions


@settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prompts=st.lists(st.lists(st.sampled_from([0, 1]), min_size=1, max_size=9), min_size=1, max_size=5),
    max_tokens=st.integers(1, 6),
    block_size=st.integers(1, 4),
    extra_blocks=st.integers(0, 10),
    budget=st.integers(1, 16),
    max_num_seqs=st.integers(1, 4),
)
def test_scheduler_outputs_do_not_depend_on_caching_or_pressure(
    prompts, max_tokens, block_size, extra_blocks, budget, max_num_seqs
):
    # enough blocks for the longest request on its own, so progress is always possible
    longest = max(len(p) for p in prompts) + max_tokens
    num_blocks = -(-longest // block_size) + extra_blocks
    reference = [run_engine([p], max_tokens, 64, block_size, 64, 1, False)[0][0] for p in prompts]
    for prefix_caching in (True, False):
        outputs, preemptions = run_engine(
            prompts, max_tokens, num_blocks, block_size, budget, max_num_seqs, prefix_caching
        )
        assert outputs == reference
        if preemptions:
            event("preempted")


def test_scheduler_rollback_of_prefix_stats_without_prefix_caching():
    # regression: with prefix caching off, a refused admission must not push the counters negative
    kv = KVCacheManager(num_blocks=1, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=16)
    sched.add(make_seq("a", [1, 2, 3]))
    sched.add(make_seq("b", [4, 5, 6]))
    out = sched.schedule()  # a takes the only block; b does not fit
    assert [s.request_id for s, _ in out.scheduled] == ["a"]
    assert kv.prefix_cache_queries == 0
