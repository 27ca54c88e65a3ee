//! Discovery, as `kubectl` reads it: `/version`, `/api`, `/apis`, `/api/v1` and `/apis/{group}/{version}`.
//! Only the legacy documents: kubectl asks for aggregated discovery (`as=APIGroupDiscoveryList`) first
//! and falls back to these when the answer is a plain `APIGroupList`.

use std::collections::BTreeMap;

use serde_json::{Value, json};

use crate::object::Gr;
use crate::store::State;

/// One resource at one version, as discovery lists it.
#[derive(Debug)]
struct Listed {
    group: String,
    version: String,
    plural: String,
    kind: String,
    namespaced: bool,
    status: bool,
    short_names: Vec<String>,
    categories: Vec<String>,
    /// The group's preferred version (a CRD's storage version).
    preferred: bool,
}

const VERBS: [&str; 8] = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"];

fn strings(v: &Value) -> Vec<String> {
    v.as_array().into_iter().flatten().filter_map(Value::as_str).map(str::to_owned).collect()
}

impl State {
    /// Every served version of every stored CRD, then the built-in and learned resources no CRD defines.
    fn listed(&self) -> Vec<Listed> {
        let mut out = Vec::new();
        for crd in self.list(&Gr::new("apiextensions.k8s.io", "customresourcedefinitions"), None) {
            let (spec, names) = (&crd["spec"], &crd["spec"]["names"]);
            let text = |v: &Value| v.as_str().unwrap_or_default().to_owned();
            for v in spec["versions"].as_array().into_iter().flatten().filter(|v| v["served"] != false) {
                out.push(Listed {
                    group: text(&spec["group"]),
                    version: text(&v["name"]),
                    plural: text(&names["plural"]),
                    kind: text(&names["kind"]),
                    namespaced: spec["scope"] != "Cluster",
                    status: v["subresources"]["status"].is_object(),
                    short_names: strings(&names["shortNames"]),
                    categories: strings(&names["categories"]),
                    preferred: v["storage"] == true,
                });
            }
        }
        for (gr, info) in self.infos() {
            if info.kind.is_empty() || out.iter().any(|l| l.group == gr.group && l.plural == gr.plural) {
                continue;
            }
            out.push(Listed {
                group: gr.group.clone(),
                version: info.api_version.rsplit('/').next().unwrap_or_default().to_owned(),
                plural: gr.plural.clone(),
                kind: info.kind.clone(),
                namespaced: info.namespaced,
                status: info.status,
                short_names: info.short_names.split_whitespace().map(str::to_owned).collect(),
                categories: Vec::new(),
                preferred: true,
            });
        }
        out.sort_by(|a, b| (&a.group, &a.version, &a.plural).cmp(&(&b.group, &b.version, &b.plural)));
        out
    }

    /// The discovery document at `path`, `None` for a path that is not one.
    pub(crate) fn discovery(&self, path: &str) -> Option<Value> {
        let parts: Vec<&str> = path.split('/').filter(|p| !p.is_empty()).collect();
        match parts.as_slice() {
            ["version"] => Some(json!({
                "major": "1", "minor": "33", "gitVersion": "v1.33.0+gpubudget-testkit", "gitCommit": "",
                "gitTreeState": "clean", "buildDate": "1970-01-01T00:00:00Z", "goVersion": "", "compiler": "gc",
                "platform": "linux/amd64",
            })),
            ["api"] => Some(json!({"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []})),
            ["apis"] => Some(group_list(&self.listed())),
            ["api", "v1"] => Some(resource_list(&self.listed(), "", "v1")),
            ["apis", group, version] => {
                let listed = self.listed();
                listed
                    .iter()
                    .any(|l| l.group == *group && l.version == *version)
                    .then(|| resource_list(&listed, group, version))
            }
            _ => None,
        }
    }
}

fn group_list(listed: &[Listed]) -> Value {
    let mut groups: BTreeMap<&str, Vec<(&str, bool)>> = BTreeMap::new();
    for l in listed.iter().filter(|l| !l.group.is_empty()) {
        let versions = groups.entry(&l.group).or_default();
        match versions.iter_mut().find(|(v, _)| *v == l.version) {
            Some((_, preferred)) => *preferred |= l.preferred,
            None => versions.push((&l.version, l.preferred)),
        }
    }
    let groups: Vec<Value> = groups
        .iter()
        .map(|(group, versions)| {
            let gv = |v: &str| json!({"groupVersion": format!("{group}/{v}"), "version": v});
            let preferred = versions.iter().find(|(_, p)| *p).unwrap_or(&versions[0]).0;
            json!({"name": group, "versions": versions.iter().map(|(v, _)| gv(v)).collect::<Vec<_>>(), "preferredVersion": gv(preferred)})
        })
        .collect();
    json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": groups})
}

fn resource_list(listed: &[Listed], group: &str, version: &str) -> Value {
    let mut resources = Vec::new();
    for l in listed.iter().filter(|l| l.group == group && l.version == version) {
        let mut r = json!({"name": l.plural, "singularName": l.kind.to_lowercase(), "namespaced": l.namespaced,
                           "kind": l.kind, "verbs": VERBS});
        if !l.short_names.is_empty() {
            r["shortNames"] = json!(l.short_names);
        }
        if !l.categories.is_empty() {
            r["categories"] = json!(l.categories);
        }
        resources.push(r);
        if l.status {
            resources
                .push(json!({"name": format!("{}/status", l.plural), "singularName": "", "namespaced": l.namespaced,
                                  "kind": l.kind, "verbs": ["get", "patch", "update"]}));
        }
        if group.is_empty() && l.plural == "pods" {
            resources.push(json!({"name": "pods/eviction", "singularName": "", "namespaced": true, "group": "policy",
                                  "version": "v1", "kind": "Eviction", "verbs": ["create"]}));
        }
    }
    let group_version = if group.is_empty() { version.to_owned() } else { format!("{group}/{version}") };
    json!({"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": group_version, "resources": resources})
}
