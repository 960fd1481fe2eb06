//! A sharded table of per-key cells, bounded and self-cleaning.

use std::cell::Cell as StdCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard, Weak};

use tollgate_core::{
    Clock, InFlight, Quota, QuotaState, RateAlgorithm, RetryBudget, RetryBudgetState,
};

use crate::cell::{Cell, Stored};
use crate::key::{BuildIdentity, KeyHash, KeyHasher};

/// What a table stores: the state type, its cell, and when it is idle.
pub(crate) trait Kind: Send + Sync + 'static {
    type State: Default + Clone + PartialEq + Send + 'static;
    type Cell: Cell<Self::State>;
    fn is_idle(&self, state: &Self::State, now: u64) -> bool;
    /// How often (ns) a shard may be swept by the background-free sweeper.
    fn sweep_every(&self) -> u64;
    /// Whether decisions read the time. A kind that does not (a count of
    /// permits) skips the clock on its hot path.
    const TIMED: bool = true;
    /// Whether its time is the wall clock (Unix time: calendar quotas)
    /// rather than the monotonic one. A table uses one or the other
    /// throughout, its sweeps included.
    const WALL: bool = false;
    /// Whether its keys are few and each is used over and over (a retry
    /// budget's upstreams): their hashes are then remembered per thread
    /// ([`KeyHasher::hash_few`]), and a stored key's state is updated
    /// under the shard's write lock alone ([`Cell::update_mut`]).
    const FEW_KEYS: bool = false;
    /// Whether a new key of a full store is decided in its shard's shared
    /// overflow state. A quota is not: a contract's count must be the
    /// key's own, so there it is decided on a scratch state that nothing
    /// keeps, and its limiter answers with an error
    /// ([`Slot::Overflow`]).
    const SHARES_OVERFLOW: bool = true;
}

const SECOND: u64 = 1_000_000_000;

impl<A: Stored> Kind for A {
    type State = A::State;
    type Cell = A::Cell;

    #[inline]
    fn is_idle(&self, state: &Self::State, now: u64) -> bool {
        RateAlgorithm::is_idle(self, state, now)
    }

    fn sweep_every(&self) -> u64 {
        self.window().clamp(SECOND, 60 * SECOND)
    }
}

impl Kind for InFlight {
    type State = u64;
    type Cell = std::sync::atomic::AtomicU64;
    const TIMED: bool = false;

    #[inline]
    fn is_idle(&self, held: &u64, _now: u64) -> bool {
        InFlight::is_idle(self, *held)
    }

    fn sweep_every(&self) -> u64 {
        SECOND
    }
}

impl Kind for Quota {
    type State = QuotaState;
    type Cell = Mutex<QuotaState>;
    const WALL: bool = true;
    const SHARES_OVERFLOW: bool = false;

    fn is_idle(&self, state: &QuotaState, now: u64) -> bool {
        Quota::is_idle(self, state, now)
    }

    fn sweep_every(&self) -> u64 {
        60 * SECOND
    }
}

impl Kind for tollgate_core::algorithm::Escalation {
    type State = tollgate_core::algorithm::EscalationState;
    type Cell = Mutex<tollgate_core::algorithm::EscalationState>;

    fn is_idle(&self, state: &Self::State, now: u64) -> bool {
        tollgate_core::algorithm::Escalation::is_idle(self, state, now)
    }

    fn sweep_every(&self) -> u64 {
        60 * SECOND
    }
}

impl Kind for RetryBudget {
    type State = RetryBudgetState;
    type Cell = Mutex<RetryBudgetState>;
    const FEW_KEYS: bool = true;

    fn is_idle(&self, state: &RetryBudgetState, now: u64) -> bool {
        RetryBudget::is_idle(self, state, now)
    }

    fn sweep_every(&self) -> u64 {
        self.window().clamp(SECOND, 60 * SECOND)
    }
}

/// Where an update ran: the key's own slot, or its shard's shared overflow
/// state (the store was full).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Slot {
    Own,
    Overflow,
}

/// What every table of one store shares: the clock, the key hasher, the
/// key budget, and the tables themselves (so a full store can reclaim idle
/// keys of any rule, not only of the one being called).
pub(crate) struct Shared<C> {
    /// Shared with the stores kept apart from this one
    /// ([`Store::apart`](tollgate_core::Store::apart)).
    pub(crate) clock: std::sync::Arc<C>,
    pub(crate) hasher: KeyHasher,
    pub(crate) keys: AtomicUsize,
    pub(crate) max_keys: usize,
    pub(crate) overflowed: AtomicU64,
    pub(crate) tables: Mutex<Vec<Weak<dyn Purge>>>,
    /// When (clock time) a full store last swept every table.
    pub(crate) last_full_sweep: AtomicU64,
}

impl<C> Shared<C> {
    pub(crate) fn new(clock: std::sync::Arc<C>, max_keys: usize) -> Self {
        Self {
            clock,
            hasher: KeyHasher::random(),
            keys: AtomicUsize::new(0),
            max_keys,
            overflowed: AtomicU64::new(0),
            tables: Mutex::new(Vec::new()),
            last_full_sweep: AtomicU64::new(0),
        }
    }

    /// Registers a table for store-wide sweeps.
    pub(crate) fn register(&self, table: Weak<dyn Purge>) {
        let mut tables = self.tables.lock().unwrap_or_else(PoisonError::into_inner);
        tables.retain(|t| t.strong_count() > 0);
        tables.push(table);
    }

    /// The store is full: drops idle keys of every table, at most once per
    /// `FULL_SWEEP_EVERY` of (monotonic) clock time. Busy shards (including
    /// the caller's, whose lock it holds) are skipped. Each table judges
    /// idleness on its own time (a quota's is the wall clock). Returns how
    /// many keys it dropped.
    fn sweep_all(&self) -> usize
    where
        C: Clock,
    {
        let now = self.clock.now();
        let last = self.last_full_sweep.load(Ordering::Relaxed);
        if now.saturating_sub(last) < FULL_SWEEP_EVERY
            || self
                .last_full_sweep
                .compare_exchange(last, now, Ordering::AcqRel, Ordering::Relaxed)
                .is_err()
        {
            return 0;
        }
        self.sweep_idle()
    }

    /// Drops idle keys of every table now (busy shards skipped), unpaced;
    /// returns how many.
    pub(crate) fn sweep_idle(&self) -> usize {
        let tables: Vec<_> = self
            .tables
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .filter_map(Weak::upgrade)
            .collect();
        tables.iter().map(|t| t.purge_idle()).sum()
    }
}

impl<C> std::fmt::Debug for Shared<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared")
            .field("keys", &self.keys)
            .field("max_keys", &self.max_keys)
            .finish_non_exhaustive()
    }
}

/// How often, at most, a full store sweeps all its tables.
const FULL_SWEEP_EVERY: u64 = 100_000_000;

/// A table that can drop its idle keys without blocking.
pub(crate) trait Purge: Send + Sync {
    /// Drops idle keys from every shard not locked right now, judged at
    /// the table's own time.
    fn purge_idle(&self) -> usize;
}

/// How many keys per shard the overflow state remembers as its members.
const MEMBERS: usize = 256;

/// The slots of the last `MEMBERS` distinct keys decided in a shard's
/// overflow state (0 is an empty place). A key that falls out of it before
/// it gets its own slot starts from a whole budget: a bounded leak, only
/// under a flood of more than `MEMBERS` keys per shard. A ring for the
/// order and a set for lookups: every key of a flood asks, so both are
/// O(1).
#[derive(Debug, Default)]
struct Members(Mutex<MemberRing>);

#[derive(Debug)]
struct MemberRing {
    ring: Box<[u64; MEMBERS]>,
    next: usize,
    set: std::collections::HashSet<u64, BuildIdentity>,
}

impl Default for MemberRing {
    fn default() -> Self {
        Self {
            ring: Box::new([0; MEMBERS]),
            next: 0,
            set: std::collections::HashSet::with_capacity_and_hasher(
                MEMBERS,
                BuildIdentity::default(),
            ),
        }
    }
}

impl Members {
    fn lock(&self) -> std::sync::MutexGuard<'_, MemberRing> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn contains(&self, slot: u64) -> bool {
        slot != 0 && self.lock().set.contains(&slot)
    }

    fn insert(&self, slot: u64) {
        let mut g = self.lock();
        if slot == 0 || g.set.contains(&slot) {
            return;
        }
        let at = g.next;
        if let Some(place) = g.ring.get_mut(at) {
            let evicted = std::mem::replace(place, slot);
            if evicted != 0 {
                g.set.remove(&evicted);
            }
        }
        g.set.insert(slot);
        g.next = at.saturating_add(1) % MEMBERS;
    }
}

/// A shard never sweeps on growth below this many keys.
const MIN_SWEEP_LEN: usize = 64;

/// A sweep shrinks a shard's table that has room for more than this many
/// keys and four times as many as it keeps.
const MIN_SHRINK: usize = 16;

/// One decision in this many, per thread, checks one shard for idle keys.
const SWEEP_TICK: u32 = 4096;

// Cache-line sized and aligned so neighbouring shards' locks do not share a line.
#[repr(align(128))]
struct Shard<Ce> {
    map: RwLock<HashMap<u64, Ce, BuildIdentity>>,
    /// Shared by every key that found the table full (see the crate docs).
    overflow: Ce,
    /// The keys most recently decided in `overflow`.
    overflow_members: Members,
    /// Sweep before growing past this length.
    next_sweep: AtomicUsize,
    last_sweep: AtomicU64,
    pins: Pins<Ce>,
}

pub(crate) struct Table<K: Kind, C> {
    pub(crate) kind: K,
    /// Shared with the tables of a rule's later parameters, where they go
    /// on from its states (see `MemoryStore::rebinding`).
    shards: std::sync::Arc<ShardSet<K::Cell, C>>,
    mask: usize,
    pub(crate) shared: std::sync::Arc<Shared<C>>,
    cursor: AtomicUsize,
}

/// A table's shards: shared by the tables of one rule's successive
/// parameters (see `Table::sharing`). When the last table goes — a rule
/// rebound on reload, and its last limiter dropped — the keys it held are
/// given back to the store's count.
struct ShardSet<Ce, C> {
    shards: Box<[Shard<Ce>]>,
    shared: std::sync::Arc<Shared<C>>,
    /// How many keys are pinned ([`Table::pin`]), at most [`MAX_PINS`].
    pinned: AtomicUsize,
}

/// The most keys a table pins: a pin is for a key every request of a
/// limit shares (one a binding), never swept and outside `max_keys`.
pub(crate) const MAX_PINS: usize = 16;

/// A shard's keys kept apart from its map ([`Table::pin`]): a shared cell
/// each, which its holder updates without a lookup, and which the shard's
/// own lookups find on a miss.
struct Pins<Ce> {
    /// Whether the shard has any: a miss's one check otherwise.
    any: std::sync::atomic::AtomicBool,
    cells: RwLock<Vec<(u64, std::sync::Arc<Ce>)>>,
}

impl<Ce> Pins<Ce> {
    fn find(cells: &[(u64, std::sync::Arc<Ce>)], slot: u64) -> Option<&std::sync::Arc<Ce>> {
        cells.iter().find(|(s, _)| *s == slot).map(|(_, cell)| cell)
    }
}

impl<Ce, C> std::ops::Deref for ShardSet<Ce, C> {
    type Target = [Shard<Ce>];

    fn deref(&self) -> &[Shard<Ce>] {
        &self.shards
    }
}

impl<Ce, C> Drop for ShardSet<Ce, C> {
    fn drop(&mut self) {
        let held: usize = self.shards.iter().map(|s| read(&s.map).len()).sum();
        self.shared.keys.fetch_sub(held, Ordering::AcqRel);
    }
}

impl<K: Kind + std::fmt::Debug, C> std::fmt::Debug for Table<K, C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Table")
            .field("kind", &self.kind)
            .field("shards", &self.shards.len())
            .finish_non_exhaustive()
    }
}

fn read<T>(lock: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    lock.read().unwrap_or_else(PoisonError::into_inner)
}

fn write<T>(lock: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    lock.write().unwrap_or_else(PoisonError::into_inner)
}

/// The write lock if it is free now; a poisoned lock is taken as any other
/// (a panic under it must not stop the shard's sweeps for good).
fn try_write<T>(lock: &RwLock<T>) -> Option<RwLockWriteGuard<'_, T>> {
    match lock.try_write() {
        Ok(guard) => Some(guard),
        Err(std::sync::TryLockError::Poisoned(poisoned)) => Some(poisoned.into_inner()),
        Err(std::sync::TryLockError::WouldBlock) => None,
    }
}

thread_local! {
    static TICK: StdCell<u32> = const { StdCell::new(0) };
}

impl<K: Kind, C: Clock> Table<K, C> {
    /// `shards` is a power of two (the builder checks).
    pub(crate) fn new(kind: K, shards: usize, shared: std::sync::Arc<Shared<C>>) -> Self {
        let shards: Box<[_]> = (0..shards.max(1))
            .map(|_| Shard {
                map: RwLock::new(HashMap::default()),
                overflow: K::Cell::new(K::State::default()),
                overflow_members: Members::default(),
                next_sweep: AtomicUsize::new(MIN_SWEEP_LEN),
                last_sweep: AtomicU64::new(0),
                pins: Pins {
                    any: std::sync::atomic::AtomicBool::new(false),
                    cells: RwLock::new(Vec::new()),
                },
            })
            .collect();
        let shards = std::sync::Arc::new(ShardSet {
            shards,
            shared: std::sync::Arc::clone(&shared),
            pinned: AtomicUsize::new(0),
        });
        Self {
            kind,
            mask: shards.len().saturating_sub(1),
            shards,
            shared,
            cursor: AtomicUsize::new(0),
        }
    }

    /// A new table, registered with its store for store-wide sweeps.
    pub(crate) fn registered(
        kind: K,
        shards: usize,
        shared: std::sync::Arc<Shared<C>>,
    ) -> std::sync::Arc<Self> {
        let table = std::sync::Arc::new(Self::new(kind, shards, shared));
        let weak: Weak<dyn Purge> = std::sync::Arc::downgrade(&table) as Weak<dyn Purge>;
        table.shared.register(weak);
        table
    }

    /// A table of `kind` over this table's keys and states, registered
    /// with the store: a rule's new parameters going on from its states.
    pub(crate) fn sharing(&self, kind: K) -> std::sync::Arc<Self> {
        let table = std::sync::Arc::new(Self {
            kind,
            shards: std::sync::Arc::clone(&self.shards),
            mask: self.mask,
            shared: std::sync::Arc::clone(&self.shared),
            cursor: AtomicUsize::new(0),
        });
        let weak: Weak<dyn Purge> = std::sync::Arc::downgrade(&table) as Weak<dyn Purge>;
        table.shared.register(weak);
        table
    }

    #[inline]
    pub(crate) fn now(&self) -> u64 {
        if !K::TIMED {
            // Only the sweeper's pacing uses it: it reads the clock itself.
            return 0;
        }
        if K::WALL {
            return self.shared.clock.unix_now();
        }
        self.shared.clock.now()
    }

    #[inline]
    fn shard(&self, index: usize) -> &Shard<K::Cell> {
        #[allow(clippy::indexing_slicing)] // masked by len − 1, len a power of two
        &self.shards[index & self.mask]
    }

    /// Runs `f` on `key`'s state. A key that is not stored and whose state
    /// `f` leaves fresh (a denial, a peek) is not stored either.
    ///
    /// `seed`: whether a key that was recently decided in the shard's shared
    /// overflow state (the store was full) starts from that state rather
    /// than from a whole budget when it gets its own slot, so the move never
    /// hands it a second budget. Only decisions that consume ask for it;
    /// releases, renewals, refunds and peeks of a key not stored never
    /// store it.
    #[inline]
    pub(crate) fn update<R>(
        &self,
        key: &[u8],
        now: u64,
        seed: bool,
        f: impl FnMut(&mut K::State) -> R,
    ) -> R {
        self.update_in(key, now, seed, f).0
    }

    /// [`update`](Self::update), also telling where it ran.
    #[inline]
    pub(crate) fn update_in<R>(
        &self,
        key: &[u8],
        now: u64,
        seed: bool,
        f: impl FnMut(&mut K::State) -> R,
    ) -> (R, Slot) {
        self.update_at(self.hash(key), now, seed, f)
    }

    /// Where `key` is kept.
    #[inline]
    pub(crate) fn hash(&self, key: &[u8]) -> KeyHash {
        if K::FEW_KEYS {
            self.shared.hasher.hash_few(key)
        } else {
            self.shared.hasher.hash(key)
        }
    }

    /// [`update_in`](Self::update_in) of the key whose hash is `hash`.
    #[inline]
    pub(crate) fn update_at<R>(
        &self,
        hash: KeyHash,
        now: u64,
        seed: bool,
        mut f: impl FnMut(&mut K::State) -> R,
    ) -> (R, Slot) {
        self.tick(now);
        let shard = self.shard(hash.shard as usize);
        if K::FEW_KEYS {
            // Few keys, each used over and over: the shard's write lock
            // alone guards the state (two atomic operations, where the
            // read lock and the key's own lock take four). Other keys of
            // the shard wait meanwhile; with few keys there seldom are any.
            if let Some(cell) = write(&shard.map).get_mut(&hash.slot) {
                return (cell.update_mut(&mut f), Slot::Own);
            }
        } else if let Some(cell) = read(&shard.map).get(&hash.slot) {
            return (cell.update(&mut f), Slot::Own);
        }
        if let Some(result) = Self::in_pin(shard, hash.slot, &mut f) {
            return (result, Slot::Own);
        }
        if seed && self.full_until_the_next_sweep(shard, now) {
            // A flood into a full store: no write lock, no second lookup,
            // no reservation that must fail; straight to the overflow
            // state, where a new key is decided while the store is full.
            // Only for decisions that consume: a refund or a peek of a key
            // not stored runs on a fresh state below and stores nothing.
            // Without the write lock this cannot see a thread that
            // inserted this key since the lookup above (a sweep freed a
            // place meanwhile): that one decision then goes to the
            // overflow state, which is bounded like any other flood key.
            return (self.overflow(shard, hash.slot, &mut f), Slot::Overflow);
        }
        let start = if seed && shard.overflow_members.contains(hash.slot) {
            shard
                .overflow
                .with(|s| (!self.kind.is_idle(s, now)).then(|| s.clone()))
        } else {
            None
        };
        let seeded = start.is_some();
        let mut fresh = start.unwrap_or_default();
        let result = f(&mut fresh);
        if !seeded && fresh == K::State::default() {
            return (result, Slot::Own);
        }
        let mut map = write(&shard.map);
        if let Some(cell) = map.get_mut(&hash.slot) {
            // Inserted by another thread meanwhile: decide on its state
            // (held exclusively, under the write lock).
            return (cell.update_mut(&mut f), Slot::Own);
        }
        // Pinned meanwhile (a pin moves the key out under this lock).
        if let Some(result) = Self::in_pin(shard, hash.slot, &mut f) {
            return (result, Slot::Own);
        }
        if !self.reserve(shard, &mut map, now) {
            drop(map);
            return (self.overflow(shard, hash.slot, &mut f), Slot::Overflow);
        }
        map.insert(hash.slot, K::Cell::new(fresh));
        (result, Slot::Own)
    }

    /// Runs `f` on the cell of the key in `slot` if `shard` pins it.
    #[inline]
    fn in_pin<R>(
        shard: &Shard<K::Cell>,
        slot: u64,
        f: &mut impl FnMut(&mut K::State) -> R,
    ) -> Option<R> {
        if !shard.pins.any.load(Ordering::Acquire) {
            return None;
        }
        Self::in_pinned(shard, slot, f)
    }

    #[cold]
    fn in_pinned<R>(
        shard: &Shard<K::Cell>,
        slot: u64,
        f: &mut impl FnMut(&mut K::State) -> R,
    ) -> Option<R> {
        let cells = read(&shard.pins.cells);
        Some(Pins::find(&cells, slot)?.update(f))
    }

    /// The cell of the key whose hash is `hash`, kept apart from its
    /// shard's map from now on (moved out with the state it had there), so
    /// that its holder updates it with no lookup; the shard's own lookups
    /// of the key find it there. Pinning a key twice gives the same cell;
    /// `None` once the table pins [`MAX_PINS`] keys.
    pub(crate) fn pin(&self, hash: KeyHash) -> Option<std::sync::Arc<K::Cell>> {
        let shard = self.shard(hash.shard as usize);
        let pins = &shard.pins;
        if let Some(cell) = Pins::find(&read(&pins.cells), hash.slot) {
            return Some(std::sync::Arc::clone(cell));
        }
        // The map's lock first, as a lookup that misses takes them.
        let mut map = write(&shard.map);
        let mut cells = write(&pins.cells);
        if let Some(cell) = Pins::find(&cells, hash.slot) {
            return Some(std::sync::Arc::clone(cell));
        }
        let taken = self
            .shards
            .pinned
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < MAX_PINS).then_some(n.saturating_add(1))
            });
        if taken.is_err() {
            return None;
        }
        let state = match map.remove(&hash.slot) {
            Some(cell) => {
                self.shared.keys.fetch_sub(1, Ordering::AcqRel);
                cell.with(Clone::clone)
            }
            None => K::State::default(),
        };
        let cell = std::sync::Arc::new(K::Cell::new(state));
        cells.push((hash.slot, std::sync::Arc::clone(&cell)));
        pins.any.store(true, Ordering::Release);
        drop(map);
        Some(cell)
    }

    /// Decides in `shard`'s overflow state, remembering `slot` as a member.
    fn overflow<R>(
        &self,
        shard: &Shard<K::Cell>,
        slot: u64,
        f: &mut impl FnMut(&mut K::State) -> R,
    ) -> R {
        self.shared.overflowed.fetch_add(1, Ordering::Relaxed);
        if !K::SHARES_OVERFLOW {
            return f(&mut K::State::default());
        }
        shard.overflow_members.insert(slot);
        shard.overflow.update(f)
    }

    /// Whether the store is full and no sweep could make room before the
    /// next is due (so a new key can go to the overflow state without the
    /// write lock). Only for kinds on the store's monotonic clock, which
    /// the sweeps' pacing reads.
    #[inline]
    fn full_until_the_next_sweep(&self, shard: &Shard<K::Cell>, now: u64) -> bool {
        K::TIMED
            && !K::WALL
            && self.shared.keys.load(Ordering::Acquire) >= self.shared.max_keys
            && now.saturating_sub(shard.last_sweep.load(Ordering::Relaxed)) < FULL_SWEEP_EVERY
            && now.saturating_sub(self.shared.last_full_sweep.load(Ordering::Relaxed))
                < FULL_SWEEP_EVERY
    }

    /// Runs `f` on the overflow state of the shard of the key whose hash
    /// is `hash` (where it was decided while the table was full).
    pub(crate) fn update_overflow<R>(&self, hash: KeyHash, f: impl FnMut(&mut K::State) -> R) -> R {
        self.shard(hash.shard as usize).overflow.update(f)
    }

    /// Makes room for one more key in `shard`: sweeps on growth, and
    /// takes one unit of the store's key budget. `false` when full.
    fn reserve(
        &self,
        shard: &Shard<K::Cell>,
        map: &mut HashMap<u64, K::Cell, BuildIdentity>,
        now: u64,
    ) -> bool {
        // Inserting is the rare path: an untimed kind reads the clock here,
        // for the sweeps' pacing.
        let now = if K::TIMED {
            now
        } else {
            self.shared.clock.now()
        };
        let mut swept = false;
        if map.len() >= shard.next_sweep.load(Ordering::Relaxed) {
            self.sweep(shard, map, now);
            swept = true;
        }
        let mut swept_all = false;
        loop {
            if self.shared.keys.fetch_add(1, Ordering::AcqRel) < self.shared.max_keys {
                return true;
            }
            self.shared.keys.fetch_sub(1, Ordering::AcqRel);
            // Full. Sweeping the shard costs a pass over all its keys:
            // done on every new key of a flood, it made each one cost a
            // full pass (tens of µs) under the write lock that known keys
            // wait on. So a full shard is swept at most once per
            // `FULL_SWEEP_EVERY`; in between, a new key goes straight to
            // the overflow state.
            let due = sweep_due(
                now,
                shard.last_sweep.load(Ordering::Relaxed),
                FULL_SWEEP_EVERY,
            );
            if !swept && due && self.sweep(shard, map, now) > 0 {
                swept = true;
                continue;
            }
            swept = true;
            // Idle keys of other rules (or other shards) hold the budget too.
            if swept_all || self.shared.sweep_all() == 0 {
                return false;
            }
            swept_all = true;
        }
    }

    /// Drops idle keys from one shard; returns how many.
    fn sweep(
        &self,
        shard: &Shard<K::Cell>,
        map: &mut HashMap<u64, K::Cell, BuildIdentity>,
        now: u64,
    ) -> usize {
        let before = map.len();
        map.retain(|_, cell| !cell.with(|s| self.kind.is_idle(s, now)));
        let after = map.len();
        let removed = before.saturating_sub(after);
        self.shared.keys.fetch_sub(removed, Ordering::AcqRel);
        // Mostly empty: give the memory back (at any size, so a store
        // left quiet after a flood shrinks to nothing).
        if map.capacity() > after.saturating_mul(4).max(MIN_SHRINK) {
            map.shrink_to_fit();
        }
        shard.next_sweep.store(
            after.saturating_mul(2).max(MIN_SWEEP_LEN),
            Ordering::Relaxed,
        );
        shard.last_sweep.store(now, Ordering::Relaxed);
        removed
    }

    /// Every `SWEEP_TICK` decisions on a thread, looks at the next shard
    /// and sweeps it if it was not swept for a while, so memory comes back
    /// after a key flood without a background thread or a user call.
    #[inline]
    fn tick(&self, now: u64) {
        let due = TICK.with(|t| {
            let v = t.get().wrapping_add(1);
            t.set(v);
            v % SWEEP_TICK == 0
        });
        if due {
            // The caller's `now` is 0 for untimed kinds: read the clock.
            let now = if K::TIMED {
                now
            } else {
                self.shared.clock.now()
            };
            self.sweep_one(now);
        }
    }

    #[cold]
    fn sweep_one(&self, now: u64) {
        let shard = self.shard(self.cursor.fetch_add(1, Ordering::Relaxed));
        if !sweep_due(
            now,
            shard.last_sweep.load(Ordering::Relaxed),
            self.kind.sweep_every(),
        ) {
            return;
        }
        // Never wait for a busy shard: it will be looked at again.
        if let Some(mut map) = try_write(&shard.map) {
            self.sweep(shard, &mut map, now);
        }
    }

    /// Sweeps every shard now, waiting for busy ones.
    pub(crate) fn purge(&self, now: u64) -> usize {
        self.shards
            .iter()
            .map(|shard| self.sweep(shard, &mut write(&shard.map), now))
            .sum()
    }
}

/// Whether a sweep last run at `last` is due again at `now`. A clock that
/// went back (a quota table's wall clock, stepped by NTP) makes it due
/// rather than stopping the sweeps until the clock catches up.
#[inline]
fn sweep_due(now: u64, last: u64, every: u64) -> bool {
    match now.checked_sub(last) {
        Some(elapsed) => elapsed >= every,
        None => true,
    }
}

impl<K: Kind, C: Clock> Purge for Table<K, C> {
    fn purge_idle(&self) -> usize {
        let now = if K::TIMED || K::WALL {
            self.now()
        } else {
            self.shared.clock.now()
        };
        self.shards
            .iter()
            .filter_map(|shard| {
                let mut map = try_write(&shard.map)?;
                Some(self.sweep(shard, &mut map, now))
            })
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::{sweep_due, Purge, Shared, Table};
    use std::sync::Arc;
    use std::time::Duration;
    use tollgate_core::{ManualClock, RetryBudget};

    #[test]
    fn a_panic_under_a_shards_lock_does_not_stop_its_sweeps() {
        let clock = ManualClock::new();
        let shared = Arc::new(Shared::new(Arc::new(clock.clone()), 1_000));
        let budget = RetryBudget::new(0.2, 0, Duration::from_secs(1)).unwrap();
        let table = Table::new(budget, 1, shared);
        let now = table.now();
        table.update(b"upstream", now, true, |s| budget.deposit(s, now));
        // A stored key of a retry budget is updated under the shard's
        // write lock: a panic there poisons it.
        let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            table.update(b"upstream", now, true, |_| panic!("in a decision"))
        }));
        assert!(panicked.is_err());
        assert!(table.shards.first().unwrap().map.is_poisoned());
        // The key's deposit lapses with the window; the sweep that never
        // waits (try_write) still reaches the poisoned shard.
        clock.advance(Duration::from_secs(3));
        assert_eq!(table.purge_idle(), 1);
        let later = table.now();
        assert_eq!(
            table.update(b"upstream", later, false, |s| budget.balance(s, later)),
            0
        );
    }

    #[test]
    fn sweeps_are_paced_and_a_clock_stepped_back_makes_one_due() {
        assert!(!sweep_due(1_050, 1_000, 100));
        assert!(sweep_due(1_100, 1_000, 100));
        assert!(
            sweep_due(900, 1_000, 100),
            "a wall clock stepped back stalls sweeps"
        );
    }
}
