//! A decision server's limits, loaded from its policy file and kept in
//! step with it, the file's `[store]` included.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use axum::body::Body;
use tollgate::config::{PolicyFile, Reloader, ServerSettings, Tollgate};
use tollgate::store::AnyLimiter;
use tollgate::{AnyStore, MemoryStore, Store};

use crate::envoy::Domains;
use crate::rls::Rls;

/// What a policy file makes of a decision server: the decision endpoints'
/// limits ([`gate`](Self::gate), for [`decisions`](crate::decisions)) and,
/// where `[server] envoy` names files, Envoy's rate limit service over
/// them ([`envoy`](Self::envoy)), both on the file's `[store]`, and a
/// [`reloader`](Self::reloader) that keeps them in step with the file.
///
/// A reload applies every section the decision endpoints read, `[store]`
/// included: a changed `[store]` moves the endpoints' limits and the
/// Envoy descriptors' counters to the new store (each counts there from
/// what it holds: nothing, for a store new to the service), and the
/// leases the old store holds go back to it. (`[server]` itself — where
/// to listen, TLS, which Envoy files — applies at the next start; the
/// Envoy files' contents reload on their own, with
/// [`Envoy::watch`].)
pub struct Loaded {
    /// The file's `[server]` section.
    pub settings: ServerSettings,
    /// The decision endpoints' limits.
    pub gate: Tollgate<AnyStore>,
    /// Keeps [`gate`](Self::gate) (and [`envoy`](Self::envoy)) in step
    /// with the file: [`spawn`](Reloader::spawn) it.
    pub reloader: Reloader<Body, AnyStore>,
    /// Envoy's rate limit service, where `[server] envoy` names files.
    pub envoy: Option<Arc<Envoy>>,
    /// The store the limits decide on now.
    current: Arc<Mutex<AnyStore>>,
}

impl std::fmt::Debug for Loaded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Loaded")
            .field("settings", &self.settings)
            .field("envoy", &self.envoy.is_some())
            .finish_non_exhaustive()
    }
}

impl Loaded {
    /// Loads the policy file at `path`: its limits on its `[store]` (the
    /// in-memory store without one), and the Envoy files its `[server]`
    /// names. Call it inside a Tokio runtime (a Redis store starts its
    /// connection task), after the metrics recorder is installed (each
    /// limit registers its metrics when it is built). Errors name the
    /// file, line and field (an Envoy file's, its descriptor).
    ///
    /// A reload that changes `[store]` is refused (the running policy
    /// stays) if the Envoy configuration running cannot be bound on the
    /// new store.
    pub fn load(path: impl AsRef<Path>) -> Result<Self, crate::BoxError> {
        let path = path.as_ref();
        let file = PolicyFile::read(path)?;
        let settings = file.server()?;
        let envoy: Arc<OnceLock<Arc<Envoy>>> = Arc::default();
        // Set to the file's store below, before a reload can run.
        let current: Arc<Mutex<AnyStore>> = Arc::new(Mutex::new(MemoryStore::new().into()));
        let check = {
            let envoy = Arc::clone(&envoy);
            move |new: &AnyStore| match envoy.get() {
                Some(envoy) => envoy.check(new),
                None => Ok(()),
            }
        };
        let moved = {
            let (envoy, current) = (Arc::clone(&envoy), Arc::clone(&current));
            move |new: &AnyStore| {
                if let Some(envoy) = envoy.get() {
                    envoy.move_to(new);
                }
                *current.lock().unwrap_or_else(PoisonError::into_inner) = new.clone();
            }
        };
        let (gate, reloader, store) = Tollgate::decisions_from_file(path, &file, check, moved)?;
        *current.lock().unwrap_or_else(PoisonError::into_inner) = store.clone();
        let loaded_envoy = if settings.envoy.is_empty() {
            None
        } else {
            let e = Arc::new(Envoy::load(settings.envoy.clone(), store)?);
            let _ = envoy.set(Arc::clone(&e));
            Some(e)
        };
        Ok(Self {
            settings,
            gate,
            reloader,
            envoy: loaded_envoy,
            current,
        })
    }

    /// The store the limits decide on now (a reload may have moved them).
    pub fn store(&self) -> AnyStore {
        (self.current_store())()
    }

    /// What tells the store the limits decide on at the time it is asked,
    /// for after the [`reloader`](Self::reloader) is spawned (e.g. to give
    /// back the leases it holds when the server stops).
    pub fn current_store(&self) -> impl Fn() -> AnyStore + Send + Sync + 'static {
        let current = Arc::clone(&self.current);
        move || {
            current
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clone()
        }
    }
}

/// Envoy's rate limit service over its configuration files, on the store
/// the policy file's limits decide on: [`rls`](Self::rls) serves it;
/// [`watch`](Self::watch) reloads the files; a policy reload that changes
/// `[store]` moves it (the configuration running, on the new store).
pub struct Envoy {
    files: Vec<PathBuf>,
    rls: Rls<AnyLimiter>,
    /// The store its descriptors are bound to and the files' texts they
    /// were bound from; held while they are bound and swapped in, so a
    /// reload of the files and a move to a new store never cross.
    running: Mutex<(AnyStore, Vec<(PathBuf, String)>)>,
    /// The texts [`check`](Self::check) found bind on a new store: what a
    /// move binds if the files reloaded in between do not.
    checked: Mutex<Vec<(PathBuf, String)>>,
}

impl std::fmt::Debug for Envoy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Envoy")
            .field("files", &self.files)
            .finish_non_exhaustive()
    }
}

impl Envoy {
    /// The service over `files`' descriptors on `store`.
    pub fn load(files: Vec<PathBuf>, store: AnyStore) -> Result<Self, crate::BoxError> {
        let texts = crate::envoy::read(&files)?;
        let domains = Domains::from_texts(&texts, &store)?;
        Ok(Self {
            files,
            rls: Rls::new(domains),
            running: Mutex::new((store, texts)),
            checked: Mutex::default(),
        })
    }

    /// The service, to serve with [`rls::serve_with`](crate::rls::serve_with).
    pub fn rls(&self) -> Rls<AnyLimiter> {
        self.rls.clone()
    }

    fn running(&self) -> std::sync::MutexGuard<'_, (AnyStore, Vec<(PathBuf, String)>)> {
        self.running.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether the configuration running binds on `store` (through a
    /// handle that binds nothing).
    fn check(&self, store: &AnyStore) -> Result<(), String> {
        let texts = self.running().1.clone();
        Domains::from_texts(&texts, &store.checking())
            .map_err(|e| format!("the Envoy rate limit configuration: {e}"))?;
        *self.checked.lock().unwrap_or_else(PoisonError::into_inner) = texts;
        Ok(())
    }

    /// Binds the configuration running on `store`, new to it (checked by
    /// [`check`](Self::check) before the policy moved), and decides there
    /// from now.
    fn move_to(&self, store: &AnyStore) {
        let mut running = self.running();
        // The texts running, or — if the files reloaded since the check
        // and theirs do not bind there — the ones the check bound.
        let checked =
            std::mem::take(&mut *self.checked.lock().unwrap_or_else(PoisonError::into_inner));
        let bound = match Domains::from_texts(&running.1, store) {
            Ok(domains) => Ok((domains, None)),
            Err(e) => Domains::from_texts(&checked, store)
                .map(|domains| (domains, Some(checked)))
                .map_err(|_| e),
        };
        match bound {
            Ok((domains, texts)) => {
                self.rls.replace(domains);
                running.0 = store.clone();
                if let Some(texts) = texts {
                    running.1 = texts;
                }
                tracing::info!("Envoy rate limit service moved to the new [store]");
            }
            // Checked before the move: only a store that changed its mind.
            Err(e) => tracing::error!(
                error = %e,
                "Envoy rate limit configuration cannot be bound on the new [store]; \
                 it stays on the old one"
            ),
        }
    }

    /// Reloads the configuration files on SIGHUP and when their contents
    /// change (see [`rls::watch`](crate::rls::watch)), on the store the
    /// descriptors are bound to then.
    pub fn watch(self: &Arc<Self>, poll: std::time::Duration) -> tokio::task::JoinHandle<()> {
        let this = Arc::clone(self);
        crate::rls::watch_files(self.files.clone(), poll, move |files| {
            let mut running = this.running();
            if let Some(texts) = crate::rls::reload(files, &running.0, &this.rls) {
                running.1 = texts;
            }
        })
    }
}
