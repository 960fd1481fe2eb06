//! Reloading a policy file while the server runs.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::Poll;
use std::time::Duration;

use tollgate_core::Store;

use super::{FileError, PolicyFile};
use crate::policy::{PolicyLayer, PolicyLayerBuilder};
use crate::MemoryStore;

type Prepare = Arc<dyn Fn(PolicyFile) -> Result<PolicyFile, FileError> + Send + Sync>;

/// What a reload also applies: the other sections' layers, built from
/// the file on a store handle (`true`: a new store, where no limit's
/// state carries over), and applied by the closure returned.
type Also<St> = Arc<
    dyn Fn(&PolicyFile, &St, bool) -> Result<Box<dyn FnOnce() + Send>, FileError> + Send + Sync,
>;

/// The store a file's changed `[store]` names, built; and what is done
/// with the store it replaces, once nothing new is decided on it.
/// How a reload builds a changed `[store]`, and what it does with the
/// store it leaves (given the one it moved to).
type Restore<St> = (
    Arc<dyn Fn(&PolicyFile) -> Result<St, FileError> + Send + Sync>,
    Arc<dyn Fn(St, &St) + Send + Sync>,
);

type Customize<B> = Arc<
    dyn Fn(PolicyLayerBuilder<B, MemoryStore>) -> PolicyLayerBuilder<B, MemoryStore> + Send + Sync,
>;

/// Keeps a [`PolicyLayer`] in step with its file: [`reload`](Self::reload)
/// on demand, or [`spawn`](Self::spawn) a task that reloads on SIGHUP and
/// when the file's contents change. See the [module docs](super) for what
/// a reload keeps.
///
/// ```no_run
/// use std::time::Duration;
/// use tollgate::config::Reloader;
/// use tollgate::MemoryStore;
///
/// # async fn run() -> Result<(), tollgate::config::FileError> {
/// let (layer, reloader) =
///     Reloader::<axum::body::Body, _>::load("policy.toml", MemoryStore::new())?;
/// reloader.spawn(Duration::from_secs(2));
/// let app: axum::Router = axum::Router::new()
///     .route("/", axum::routing::get(|| async { "hi" }))
///     .layer(layer);
/// # let _ = app;
/// # Ok(())
/// # }
/// ```
pub struct Reloader<B, St: Store> {
    path: PathBuf,
    /// The store the running policy is on (replaced when a reload
    /// applies a new `[store]`, with [`restore`](Self::restore)).
    store: Mutex<St>,
    restore: Option<Restore<St>>,
    layer: PolicyLayer<B, St>,
    customize: Option<Customize<B>>,
    prepare: Option<Prepare>,
    also: Option<Also<St>>,
    /// The text of the policy running, and with it the stamps of the
    /// files it names ([`PolicyFile::watched`]): a change to either
    /// reloads.
    running: Mutex<(String, String)>,
    /// The text (and files) last tried, applied or not: polls skip it, so
    /// a bad file is reported once, not on every poll.
    tried: Mutex<String>,
    /// The text the last poll read: a poll applies a text only when the
    /// poll before read it too.
    settling: Mutex<String>,
    /// Whether reloads attach the file's `[audit] stream` (as the first
    /// layer did: built by [`load`](Self::load) or a `Tollgate`).
    streams: bool,
}

impl<B, St: Store> fmt::Debug for Reloader<B, St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Reloader")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

/// What a reload did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Reloaded {
    /// The file changed and its policy now runs.
    Applied,
    /// The file is as it was: nothing to do.
    Unchanged,
}

impl<B, St: Store> Reloader<B, St> {
    /// Loads the policy at `path` onto `store`, and a reloader for it.
    /// Errors name the file, line and field.
    pub fn load(
        path: impl AsRef<Path>,
        store: St,
    ) -> Result<(PolicyLayer<B, St>, Self), FileError> {
        let file = PolicyFile::read(path.as_ref())?;
        let layer = file.layer::<B, St>(&store)?;
        let reloader = Self::new(path, &file, store, &layer);
        Ok((layer, reloader))
    }

    /// [`load`](Self::load), with what a file cannot hold added to the
    /// first policy and to every reloaded one alike (a rejection, an audit
    /// sink, a plan closure): one closure for both, so a reload can never
    /// drop what the first build had.
    ///
    /// ```no_run
    /// use tollgate::config::Reloader;
    /// use tollgate::MemoryStore;
    ///
    /// # fn run() -> Result<(), tollgate::config::FileError> {
    /// let (layer, reloader) = Reloader::<axum::body::Body, _>::load_with(
    ///     "policy.toml",
    ///     MemoryStore::new(),
    ///     |b| b.plan_from_extension(),
    /// )?;
    /// # let _ = (layer, reloader);
    /// # Ok(())
    /// # }
    /// ```
    pub fn load_with<F>(
        path: impl AsRef<Path>,
        store: St,
        customize: F,
    ) -> Result<(PolicyLayer<B, St>, Self), FileError>
    where
        F: Fn(PolicyLayerBuilder<B, MemoryStore>) -> PolicyLayerBuilder<B, MemoryStore>
            + Send
            + Sync
            + 'static,
    {
        let file = PolicyFile::read(path.as_ref())?;
        let layer = file
            .audit_stream(&store, customize(file.builder::<B>()?).store(store.clone()))?
            .build()
            .map_err(|e| file.config_error(&e))?;
        let reloader = Self::new(path, &file, store, &layer)
            .customize(customize)
            .with_audit_stream();
        Ok((layer, reloader))
    }

    /// A reloader for `layer`, built from `file` (which was read from
    /// `path`) on `store`. If `layer` was built with additions a file
    /// cannot hold, give the reloader the same ones with
    /// [`customize`](Self::customize), or a reload drops them without a
    /// word: [`load_with`](Self::load_with) does both in one. A file's
    /// `[audit] stream` is attached by the constructors that build the
    /// layer themselves ([`load`](Self::load), [`load_with`](Self::load_with),
    /// a `Tollgate`'s): a layer built by hand from
    /// [`PolicyFile::builder`] records to the log, and so does each of
    /// its reloads.
    pub fn new(
        path: impl AsRef<Path>,
        file: &PolicyFile,
        store: St,
        layer: &PolicyLayer<B, St>,
    ) -> Self {
        Self {
            path: path.as_ref().to_owned(),
            store: Mutex::new(store),
            restore: None,
            layer: layer.clone(),
            customize: None,
            prepare: None,
            also: None,
            running: Mutex::new((file.text().to_owned(), file.watched())),
            tried: Mutex::new(file.watched()),
            settling: Mutex::new(file.watched()),
            streams: false,
        }
    }

    /// Reloads attach the file's `[audit] stream`, as the first layer's
    /// build did.
    pub(crate) fn with_audit_stream(mut self) -> Self {
        self.streams = true;
        self
    }

    /// What to add to every reloaded policy that a file cannot hold (a
    /// rejection, an audit sink, a plan closure): the same as was added to
    /// the first (build that one with [`PolicyFile::builder`], the same
    /// additions, and [`Reloader::new`]). A reload checks the file with
    /// them on a throwaway store before it touches the running one.
    pub fn customize<F>(mut self, f: F) -> Self
    where
        F: Fn(PolicyLayerBuilder<B, MemoryStore>) -> PolicyLayerBuilder<B, MemoryStore>
            + Send
            + Sync
            + 'static,
    {
        self.customize = Some(Arc::new(f));
        self
    }

    /// What to do to every file read before it is built: the same as was
    /// done to the first, e.g.
    /// `|f| f.default_trusted_proxies(&from_the_environment)`.
    pub fn prepare<F>(mut self, f: F) -> Self
    where
        F: Fn(PolicyFile) -> Result<PolicyFile, FileError> + Send + Sync + 'static,
    {
        self.prepare = Some(Arc::new(f));
        self
    }

    /// What a reload applies besides the rules: `f` builds the other
    /// sections from the new file on a store handle (a checking one
    /// first, then the rebinding one) and returns what swaps them in,
    /// called with the rules' swap ([`Tollgate::reloader`](super::Tollgate::reloader)).
    #[cfg(feature = "axum")]
    pub(super) fn also<F>(mut self, f: F) -> Self
    where
        F: Fn(&PolicyFile, &St, bool) -> Result<Box<dyn FnOnce() + Send>, FileError>
            + Send
            + Sync
            + 'static,
    {
        self.also = Some(Arc::new(f));
        self
    }

    /// How a reload builds the store when the file's `[store]` changed
    /// ([`Tollgate::from_file`](super::Tollgate::from_file)): the new
    /// policy is checked and built on it, and it becomes the running
    /// store. A store that cannot be built refuses the reload.
    #[cfg(feature = "axum")]
    pub(super) fn restore<F, R>(mut self, f: F, retire: R) -> Self
    where
        F: Fn(&PolicyFile) -> Result<St, FileError> + Send + Sync + 'static,
        R: Fn(St, &St) + Send + Sync + 'static,
    {
        self.restore = Some((Arc::new(f), Arc::new(retire)));
        self
    }

    /// Reads the file and, if it changed, makes its policy the running
    /// one. A file that does not load changes nothing: the error says
    /// why, and the running policy stays.
    pub fn reload(&self) -> Result<Reloaded, FileError> {
        self.reload_unless_tried(false)
    }

    /// What one poll of [`spawn`](Self::spawn)'s task does: a text that
    /// was tried before is left alone, and a new one is applied only when
    /// the poll before read it too (never a file half written).
    pub(super) fn poll_once(&self) -> Result<Reloaded, FileError> {
        self.reload_unless_tried(true)
    }

    /// [`reload`](Self::reload), except that with `skip_tried` a file
    /// whose text was tried last (applied or rejected) is left alone.
    fn reload_unless_tried(&self, skip_tried: bool) -> Result<Reloaded, FileError> {
        let outcome = self.try_reload(skip_tried);
        let label = match &outcome {
            // A poll that found the file as last tried: not a reload.
            Ok(Reloaded::Unchanged) if skip_tried => return outcome,
            Ok(Reloaded::Applied) => {
                tracing::info!(target: "tollgate", path = %self.path.display(), "policy reloaded");
                "applied"
            }
            Ok(Reloaded::Unchanged) => "unchanged",
            Err(e) => {
                tracing::error!(
                    target: "tollgate",
                    error = %e,
                    "policy file rejected; the running policy stays"
                );
                "rejected"
            }
        };
        metrics::counter!("tollgate_config_reloads_total", "outcome" => label).increment(1);
        outcome
    }

    fn try_reload(&self, skip_tried: bool) -> Result<Reloaded, FileError> {
        // What a poll compares: the text, and the stamps of the files it
        // names (not their contents: a poll reads no list or database).
        let origin = Some(self.path.display().to_string());
        let text = super::read_text(&self.path);
        {
            let mut tried = self.tried.lock().unwrap_or_else(PoisonError::into_inner);
            let watched = match &text {
                Ok(t) => PolicyFile::parse_shape(t, origin.clone())
                    .map_or_else(|_| t.clone(), |f| f.watched()),
                Err(_) => String::new(),
            };
            let seen = watched.as_str();
            if skip_tried && *tried == seen {
                return Ok(Reloaded::Unchanged);
            }
            if skip_tried {
                // A poll may read a file an editor is still writing — cut
                // short at a rule's end, it would even load, without the
                // rules after it. A text is applied once two polls in a
                // row read it (a SIGHUP, sent once the file is written,
                // applies at once).
                let mut settling = self.settling.lock().unwrap_or_else(PoisonError::into_inner);
                if *settling != seen {
                    seen.clone_into(&mut settling);
                    return Ok(Reloaded::Unchanged);
                }
            }
            seen.clone_into(&mut tried);
        }
        // Parsed here (the files it names read with it), built once below
        // with the customisation.
        let mut file = PolicyFile::parse_unchecked(&text?, origin)?;
        if let Some(prepare) = &self.prepare {
            file = prepare(file)?;
        }
        let mut running = self.running.lock().unwrap_or_else(PoisonError::into_inner);
        if running.1 == file.watched() {
            return Ok(Reloaded::Unchanged);
        }
        let customize = |b| match &self.customize {
            Some(f) => f(b),
            None => b,
        };
        // On a throwaway store first: a file that fails to build must not
        // rebind a single rule of the running store.
        file.check::<B>(customize)?;
        // (Compared by sections: the files it names are not read again.)
        let before =
            PolicyFile::parse_shape(&running.0, Some(self.path.display().to_string())).ok();
        // A changed `[store]` (where the reloader can build one): the new
        // policy goes on the new store, from nothing.
        let new_store = match (&self.restore, &before) {
            (Some((restore, _)), Some(b)) if !file.same_store(b) => Some(restore(&file)?),
            _ => None,
        };
        let fresh = new_store.is_some();
        let store = match &new_store {
            Some(s) => s.clone(),
            None => self
                .store
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clone(),
        };
        // Then through a checking handle on the store, which binds as the
        // rebinding below will and changes nothing: what only that store
        // refuses (a name another layer binds to another kind of rule,
        // spans Redis cannot hold) stops the reload here too, not after
        // the rules before it were rebound.
        let checked = customize(file.builder::<B>()?).store(store.checking());
        metrics::with_local_recorder(&metrics::NoopRecorder, || checked.build())
            .map(drop)
            .map_err(|e| file.config_error(&e))?;
        if let Some(also) = &self.also {
            let checking = store.checking();
            metrics::with_local_recorder(&metrics::NoopRecorder, || also(&file, &checking, fresh))
                .map(drop)?;
        }
        // The running store's rules rebind (their state goes on); a new
        // store's are bound as new.
        let binding = if fresh {
            store.clone()
        } else {
            store.rebinding()
        };
        let next = customize(file.builder::<B>()?).store(binding.clone());
        let next = if self.streams {
            file.audit_stream(&binding, next)?
        } else {
            next
        };
        let next = next.build().map_err(|e| file.config_error(&e))?;
        let swap_others = match &self.also {
            Some(also) => Some(also(&file, &binding, fresh)?),
            None => None,
        };
        self.layer.replace(&next);
        if let Some(swap) = swap_others {
            swap();
        }
        if let Some(s) = new_store {
            tracing::warn!(
                target: "tollgate",
                "the policy moved to the new [store]: every limit counts there from what it \
                 holds (nothing, for a store new to this service); requests under way finish \
                 on the old one, their permits not counted by the new one until they end"
            );
            let old = std::mem::replace(
                &mut *self.store.lock().unwrap_or_else(PoisonError::into_inner),
                s.clone(),
            );
            if let Some((_, retire)) = &self.restore {
                retire(old, &s);
            }
        }
        // What a reload does not apply, said when it changed: the other
        // sections are read when their layers are built (at start).
        if let Some(before) = before {
            let mut changed = file.unapplied_changes(&before);
            if self.restore.is_some() {
                changed.retain(|c| *c != "[store]");
            }
            // With the other layers reloaded too, what stays is what no
            // layer here is built from (the store, a client's retries).
            if self.also.is_some() {
                changed.retain(|c| {
                    !matches!(
                        *c,
                        "[[quotas]]" | "[[concurrency]]" | "[[bandwidth]]" | "[costs]"
                    )
                });
            }
            if !changed.is_empty() {
                tracing::warn!(
                    target: "tollgate::config",
                    sections = %changed.join(", "),
                    "policy reloaded; the changed sections apply when their layers \
                     (or the store) are built again (at the next start)"
                );
            }
        }
        *running = (file.text().to_owned(), file.watched());
        Ok(Reloaded::Applied)
    }

    /// Spawns a task (on the current tokio runtime) that reloads on SIGHUP
    /// (Unix) and whenever the file's contents change, checked every
    /// `poll`: new contents are applied once two checks in a row read
    /// them, so a file caught while an editor writes it is never applied
    /// half written (within two polls of the change; a SIGHUP applies at
    /// once). Errors are logged and counted; the task runs until the
    /// runtime stops or the handle is aborted.
    pub fn spawn(self, poll: Duration) -> tokio::task::JoinHandle<()>
    where
        B: Send + 'static,
        St::Limiter: Send + Sync,
    {
        let this = Arc::new(self);
        tokio::spawn(async move {
            let mut triggers = Triggers::new(poll);
            loop {
                // `true`: a SIGHUP, which retries even a file tried before.
                let signalled = triggers.next().await;
                // Errors are logged and counted; a file already tried is
                // not tried again until it changes (or SIGHUP). Off the
                // runtime's workers: a reload reads files and builds
                // limits (a large list, a database).
                let reloader = Arc::clone(&this);
                let _ = tokio::task::spawn_blocking(move || {
                    if signalled {
                        reloader.reload()
                    } else {
                        reloader.poll_once()
                    }
                })
                .await;
            }
        })
    }
}

/// What makes a watched file be read again: SIGHUP (Unix), or the next
/// tick of a poll (missed ticks skipped). [`Reloader::spawn`] waits on
/// it, and so can another watcher of files (a decision server's own
/// configuration).
#[derive(Debug)]
pub struct Triggers {
    #[cfg(unix)]
    hangup: Option<tokio::signal::unix::Signal>,
    tick: tokio::time::Interval,
}

impl Triggers {
    /// SIGHUP, and a poll every `poll` (at least 10 ms). Call it inside a
    /// Tokio runtime. Without a SIGHUP handler (the platform refuses
    /// one), polls alone, and says so.
    pub fn new(poll: Duration) -> Self {
        let mut tick = tokio::time::interval(poll.max(Duration::from_millis(10)));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        Self {
            #[cfg(unix)]
            hangup: tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
                .map_err(|e| {
                    tracing::warn!(target: "tollgate", error = %e, "no SIGHUP reloads");
                })
                .ok(),
            tick,
        }
    }

    /// Waits for the next trigger: `true` for a SIGHUP, `false` for a
    /// poll's tick.
    pub async fn next(&mut self) -> bool {
        std::future::poll_fn(|cx| {
            #[cfg(unix)]
            if let Some(h) = self.hangup.as_mut() {
                match h.poll_recv(cx) {
                    Poll::Ready(Some(())) => return Poll::Ready(true),
                    // No more signals will come: stop listening.
                    Poll::Ready(None) => self.hangup = None,
                    Poll::Pending => {}
                }
            }
            self.tick.poll_tick(cx).map(|_| false)
        })
        .await
    }
}
