//! How the index runs a watch: with kube's default backoff until shutdown, each event handed on as it arrives.

use futures::StreamExt as _;
use kube::Api;
use kube::runtime::{WatchStreamExt as _, watcher};
use tokio_util::sync::CancellationToken;

/// Runs a watch with the default backoff until `shutdown`, handing each event to `on`.
pub(super) fn spawn<K, F>(
    api: Api<K>,
    config: watcher::Config,
    name: &'static str,
    shutdown: CancellationToken,
    mut on: F,
) where
    K: kube::Resource<DynamicType = ()> + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + 'static,
    F: FnMut(watcher::Event<K>) + Send + 'static,
{
    let stream = watcher(api, config).default_backoff();
    tokio::spawn(async move {
        let mut stream = std::pin::pin!(stream);
        loop {
            tokio::select! {
                () = shutdown.cancelled() => break,
                event = stream.next() => match event {
                    Some(Ok(event)) => on(event),
                    Some(Err(error)) => tracing::warn!(cache = name, %error, "watch failed; retrying with backoff"),
                    None => break,
                },
            }
        }
    });
}

/// The list or watch was answered 404: the resource (a CRD) is not installed.
pub(super) fn is_not_found(error: &watcher::Error) -> bool {
    match error {
        watcher::Error::InitialListFailed(kube::Error::Api(status))
        | watcher::Error::WatchStartFailed(kube::Error::Api(status))
        | watcher::Error::WatchFailed(kube::Error::Api(status)) => status.code == 404,
        watcher::Error::WatchError(status) => status.code == 404,
        _ => false,
    }
}
