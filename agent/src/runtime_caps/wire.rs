//! The local channel between the relay, which alone holds the runtime's NRI socket, and the agent, which decides:
//! one JSON object per line over a unix socket the relay listens on. The relay asks ([`Request`]), the agent
//! answers ([`Response`], same `id`), several in flight at once.
//!
//! Only what the decision reads crosses it: a pod's name and UID, a GPU container's ID, name, the few variables of
//! [`runtime::READ`] and its GPU device nodes ([`runtime::relevant`]) — no other variable (a container's secrets
//! stay with the runtime), no non-GPU container. And only an adjustment of [`runtime::ADJUSTABLE`] crosses back
//! ([`Answer::into_nri`] checks it): whoever answers on the channel can set a GPU container's MPS cap and memory
//! limits, or refuse it, and nothing else.

use gpubudget_common::caps::runtime;
use gpubudget_nri::api::{Container, ContainerAdjustment, LinuxContainer, LinuxDevice, PodSandbox};
use serde::{Deserialize, Serialize};
use tokio::io::AsyncWriteExt as _;
use tokio::sync::mpsc;
use tokio_util::codec::{FramedRead, LinesCodec};

/// The longest line either side reads (a container's relevant part is at most five variables of 128 KiB).
pub const MAX_LINE: usize = 1 << 20;

/// The lines read from one end of the channel, each at most [`MAX_LINE`] bytes.
pub fn lines<R: tokio::io::AsyncRead>(rd: R) -> FramedRead<R, LinesCodec> {
    FramedRead::new(rd, LinesCodec::new_with_max_length(MAX_LINE))
}

/// Writes each queued line (without its newline) to `wr`, whole, until the queue closes or a write fails.
pub async fn write_lines<W: tokio::io::AsyncWrite + Unpin>(
    mut wr: W,
    queue: &mut mpsc::Receiver<String>,
) -> std::io::Result<()> {
    while let Some(mut line) = queue.recv().await {
        line.push('\n');
        wr.write_all(line.as_bytes()).await?;
    }
    Ok(())
}

/// A pod, as the runtime names it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pod {
    /// Its UID (a static pod's is its mirror's annotation).
    pub uid: String,
    /// Its namespace.
    pub namespace: String,
    /// Its name.
    pub name: String,
}

/// A GPU container: only the part the decision reads.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ctr {
    /// The runtime's container ID.
    pub id: String,
    /// Its name in the pod.
    pub name: String,
    /// The variables of [`runtime::READ`] it will start (or started) with, `KEY=value`.
    pub env: Vec<String>,
    /// Its GPU device nodes.
    pub devices: Vec<String>,
}

/// What the relay asks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "call", rename_all = "camelCase")]
pub enum Call {
    /// A GPU container that exists (when the relay registered with the runtime, or when the agent connected): judged
    /// as it was made.
    Existing {
        /// Its pod.
        pod: Pod,
        /// The container as made.
        container: Ctr,
    },
    /// A GPU container about to be made: its adjustment, within `wait_ms` of waiting for its pod's budget.
    Create {
        /// Its pod.
        pod: Pod,
        /// The container as the runtime will make it.
        container: Ctr,
        /// How long the agent may wait for an unknown budget (the runtime's deadline, less the relay's margin).
        #[serde(rename = "waitMs")]
        wait_ms: u64,
    },
    /// A GPU container as the runtime made it (`PostCreateContainer`): the confirmation of its caps.
    Created {
        /// Its pod.
        pod: Pod,
        /// The container as made.
        container: Ctr,
    },
}

/// A question of the relay.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Request {
    /// Echoed in the answer.
    pub id: u64,
    /// What is asked.
    #[serde(flatten)]
    pub call: Call,
}

/// The agent's answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "answer", rename_all = "camelCase")]
pub enum Answer {
    /// Nothing to change.
    Done,
    /// Variables to set and to remove.
    Adjust {
        /// `(name, value)`.
        set: Vec<(String, String)>,
        /// Names.
        remove: Vec<String>,
    },
    /// Refuse the container, with the reason the runtime reports.
    Refuse {
        /// Why.
        reason: String,
    },
}

/// An answer to the request with the same `id`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Response {
    /// The request's.
    pub id: u64,
    /// The answer.
    #[serde(flatten)]
    pub answer: Answer,
}

impl Pod {
    /// The pod the runtime names.
    pub fn of(p: &PodSandbox) -> Pod {
        Pod { uid: p.uid.clone(), namespace: p.namespace.clone(), name: p.name.clone() }
    }

    /// As the runtime's type (what the decision reads of it).
    pub fn to_nri(&self) -> PodSandbox {
        PodSandbox {
            uid: self.uid.clone(),
            namespace: self.namespace.clone(),
            name: self.name.clone(),
            ..Default::default()
        }
    }
}

impl Ctr {
    /// The part of `c` the decision reads, if `c` is a GPU container (it sees a GPU device node or names GPUs in
    /// `NVIDIA_VISIBLE_DEVICES`); `None` for every other container, which never crosses the channel.
    pub fn of(c: &Container) -> Option<Ctr> {
        let paths = || c.linux.iter().flat_map(|l| l.devices.iter().map(|d| d.path.as_str()));
        runtime::devices_seen(&c.env, paths(), 0)?;
        let (env, devices) = runtime::relevant(&c.env, paths());
        Some(Ctr { id: c.id.clone(), name: c.name.clone(), env, devices })
    }

    /// As the runtime's type (what the decision reads of it).
    pub fn to_nri(&self) -> Container {
        Container {
            id: self.id.clone(),
            name: self.name.clone(),
            env: self.env.clone(),
            linux: Some(LinuxContainer {
                devices: self.devices.iter().map(|p| LinuxDevice { path: p.clone(), ..Default::default() }).collect(),
                ..Default::default()
            }),
            ..Default::default()
        }
    }
}

/// The runtime's variable name for a removal (`-NAME`).
const REMOVED: char = '-';

impl Answer {
    /// The answer for a runtime adjustment.
    pub fn of(result: Result<ContainerAdjustment, String>) -> Answer {
        match result {
            Err(reason) => Answer::Refuse { reason },
            Ok(a) if a.env.is_empty() => Answer::Done,
            Ok(a) => {
                let (mut set, mut remove) = (Vec::new(), Vec::new());
                for kv in a.env {
                    match kv.key.strip_prefix(REMOVED) {
                        Some(name) => remove.push(name.to_owned()),
                        None => set.push((kv.key, kv.value)),
                    }
                }
                Answer::Adjust { set, remove }
            }
        }
    }

    /// What the relay answers the runtime: the adjustment (checked: [`runtime::check_adjustment`]) or the refusal;
    /// `Err` when the agent's answer asks for more than runtime caps may change.
    pub fn into_nri(self) -> Result<Result<ContainerAdjustment, String>, String> {
        match self {
            Answer::Done => Ok(Ok(ContainerAdjustment::default())),
            Answer::Refuse { reason } => Ok(Err(reason)),
            Answer::Adjust { set, remove } => {
                runtime::check_adjustment(&set, &remove)?;
                let mut out = ContainerAdjustment::default();
                for (k, v) in set {
                    out.add_env(k, v);
                }
                for k in &remove {
                    out.remove_env(k);
                }
                Ok(Ok(out))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(env: &[&str]) -> Container {
        Container {
            id: "c1".into(),
            name: "main".into(),
            env: env.iter().map(|e| (*e).to_owned()).collect(),
            ..Default::default()
        }
    }

    #[test]
    fn only_gpu_containers_cross_and_only_what_the_decision_reads() {
        assert_eq!(Ctr::of(&gpu(&["PATH=/bin", "DB_PASSWORD=hunter2"])), None, "not a GPU container");
        let c = Ctr::of(&gpu(&[
            "DB_PASSWORD=hunter2",
            "NVIDIA_VISIBLE_DEVICES=0",
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=1G",
        ]))
        .expect("a GPU container");
        assert_eq!(c.env, ["NVIDIA_VISIBLE_DEVICES=0", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=1G"]);
        let line = serde_json::to_string(&Request { id: 7, call: Call::Created { pod: Pod::default(), container: c } })
            .expect("json");
        assert!(!line.contains("hunter2") && !line.contains('\n'), "{line}");
        assert!(line.starts_with(r#"{"id":7,"call":"created""#), "{line}");
    }

    #[test]
    fn an_answer_round_trips_and_nothing_beyond_the_caps_passes_the_relay() {
        let mut a = ContainerAdjustment::default();
        a.add_env("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=8192M");
        a.remove_env("NVIDIA_GPU_MEMORY_REQUEST");
        let answer = Answer::of(Ok(a.clone()));
        let line = serde_json::to_string(&Response { id: 1, answer: answer.clone() }).expect("json");
        let back: Response = serde_json::from_str(&line).expect("parse");
        assert_eq!(back.answer, answer);
        assert_eq!(back.answer.into_nri(), Ok(Ok(a)));
        assert_eq!(Answer::of(Err("no".into())).into_nri(), Ok(Err("no".into())));
        let hostile = Answer::Adjust { set: vec![("LD_PRELOAD".into(), "/x.so".into())], remove: vec![] };
        assert!(hostile.into_nri().is_err());
        let devices = Answer::Adjust { set: vec![], remove: vec!["NVIDIA_VISIBLE_DEVICES".into()] };
        assert!(devices.into_nri().is_err());
    }
}
