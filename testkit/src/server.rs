//! The HTTP side: routing a request to a resource and verb, and the verbs themselves.

use std::collections::HashMap;
use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use futures::channel::mpsc::UnboundedReceiver;
use http::{Method, Request, Response, header};
use http_body::Frame;
use serde_json::{Value, json};

use crate::object::{Gr, meta_str, partial};
use crate::select::{FieldSelector, LabelSelector};
use crate::ssa::{self, Section, Writer};
use crate::store::{Change, EvictionBlock, State, WatchSpec, now};
use crate::table::Printer;
use crate::{RecordedRequest, Verb, resource_matches};

/// The parts of a resource URL.
#[derive(Debug, Clone, Default)]
struct Route {
    group: String,
    version: String,
    plural: String,
    namespace: Option<String>,
    name: Option<String>,
    sub: Option<String>,
}

fn parse_path(path: &str) -> Option<Route> {
    let parts: Vec<&str> = path.split('/').filter(|p| !p.is_empty()).collect();
    let (group, version, rest) = match parts.as_slice() {
        ["api", version, rest @ ..] => ("", *version, rest),
        ["apis", group, version, rest @ ..] => (*group, *version, rest),
        _ => return None,
    };
    let (namespace, rest) = match rest {
        ["namespaces", ns, plural, rest @ ..] if !matches!(*plural, "status" | "finalize") => {
            (Some((*ns).to_owned()), [&[*plural][..], rest].concat())
        }
        _ => (None, rest.to_vec()),
    };
    let (plural, name, sub) = match rest.as_slice() {
        [plural] => (*plural, None, None),
        [plural, name] => (*plural, Some(*name), None),
        [plural, name, sub] => (*plural, Some(*name), Some(*sub)),
        _ => return None,
    };
    let own = |s: Option<&str>| s.map(str::to_owned);
    Some(Route {
        group: group.to_owned(),
        version: version.to_owned(),
        plural: plural.to_owned(),
        namespace,
        name: own(name),
        sub: own(sub),
    })
}

/// A response the fake gives: a JSON document, or a watch stream that ends after its timeout.
#[derive(Debug)]
pub(crate) enum Reply {
    Json(u16, Value),
    Watch(UnboundedReceiver<Bytes>, Duration),
}

fn reason_for(code: u16) -> &'static str {
    match code {
        400 => "BadRequest",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "NotFound",
        405 => "MethodNotAllowed",
        409 => "Conflict",
        410 => "Expired",
        415 => "UnsupportedMediaType",
        422 => "Invalid",
        429 => "TooManyRequests",
        503 => "ServiceUnavailable",
        504 => "Timeout",
        _ => "InternalError",
    }
}

/// A metav1 `Status` describing a failure.
pub(crate) fn failure(code: u16, message: impl Into<String>, details: Option<Value>) -> Reply {
    let mut status = json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": message.into(), "reason": reason_for(code), "code": code,
    });
    if let Some(details) = details {
        status["details"] = details;
    }
    Reply::Json(code, status)
}

fn success(code: u16, details: Option<Value>) -> Reply {
    let mut status = json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": code});
    if let Some(details) = details {
        status["details"] = details;
    }
    Reply::Json(code, status)
}

fn details(gr: &Gr, name: &str) -> Value {
    json!({"name": name, "group": gr.group, "kind": gr.plural})
}

fn not_found(gr: &Gr, name: &str) -> Reply {
    failure(404, format!("{gr} \"{name}\" not found"), Some(details(gr, name)))
}

fn conflict(gr: &Gr, name: &str, why: &str) -> Reply {
    failure(409, format!("Operation cannot be fulfilled on {gr} \"{name}\": {why}"), Some(details(gr, name)))
}

const MODIFIED: &str = "the object has been modified; please apply your changes to the latest version and try again";

/// One request, decoded.
struct Call {
    route: Route,
    gr: Gr,
    verb: Verb,
    query: HashMap<String, String>,
    body: Option<Value>,
    content_type: String,
    meta_only: bool,
    /// `Accept: ...;as=Table;g=meta.k8s.io;v=v1` (kubectl get): lists, gets and watches answer Tables.
    table: bool,
    user_agent: String,
}

type Handled = Result<Reply, Reply>;

impl Call {
    fn ns(&self) -> &str {
        self.route.namespace.as_deref().unwrap_or_default()
    }

    fn name(&self) -> &str {
        self.route.name.as_deref().unwrap_or_default()
    }

    fn flag(&self, key: &str) -> bool {
        self.query.get(key).is_some_and(|v| v == "true" || v == "1")
    }

    fn dry_run(&self) -> bool {
        self.query.contains_key("dryRun")
    }

    /// `fieldManager`, or the user agent's product, as the real server defaults it.
    fn manager(&self) -> String {
        match self.query.get("fieldManager") {
            Some(m) if !m.is_empty() => m.clone(),
            _ if !self.user_agent.is_empty() => self.user_agent.split('/').next().unwrap_or_default().to_owned(),
            _ => "unknown".to_owned(),
        }
    }

    fn body(&self) -> Result<&Value, Reply> {
        self.body
            .as_ref()
            .filter(|b| b.is_object())
            .ok_or_else(|| failure(400, "the request body is not a JSON object", None))
    }

    fn render(&self, object: &Value) -> Value {
        if self.meta_only { partial(object) } else { object.clone() }
    }

    fn printer(&self, state: &State) -> Option<Printer> {
        let include = self.query.get("includeObject").map(String::as_str);
        self.table.then(|| state.printer(&self.gr, &self.route.version, include))
    }

    fn selectors(&self) -> Result<(LabelSelector, FieldSelector), Reply> {
        let get = |k: &str| self.query.get(k).map(String::as_str).unwrap_or_default();
        let labels = LabelSelector::parse(get("labelSelector")).map_err(|e| failure(400, e, None))?;
        let fields = FieldSelector::parse(get("fieldSelector")).map_err(|e| failure(400, e, None))?;
        Ok((labels, fields))
    }

    /// The object's namespace must be the URL's (filled in when unset).
    fn check_namespace(&self, object: &mut Value) -> Result<(), Reply> {
        if let Some(ns) = &self.route.namespace {
            match object["metadata"]["namespace"].as_str() {
                None | Some("") => object["metadata"]["namespace"] = Value::String(ns.clone()),
                Some(other) if other != ns => {
                    return Err(failure(
                        400,
                        "the namespace of the provided object does not match the namespace sent on the request",
                        None,
                    ));
                }
                Some(_) => {}
            }
        }
        Ok(())
    }
}

fn is_blank(v: &Value) -> bool {
    v.is_null() || v.as_str() == Some("")
}

impl State {
    /// Serves one request and records it.
    pub(crate) fn handle(&mut self, parts: &http::request::Parts, bytes: &Bytes) -> Reply {
        let header = |h: header::HeaderName| parts.headers.get(h).and_then(|v| v.to_str().ok()).map(str::to_owned);
        let (content_type, accept) = (header(header::CONTENT_TYPE), header(header::ACCEPT));
        let route = parse_path(parts.uri.path());
        let query: HashMap<String, String> =
            form_urlencoded::parse(parts.uri.query().unwrap_or_default().as_bytes()).into_owned().collect();
        let named = route.as_ref().is_some_and(|r| r.name.is_some());
        let watch = query.get("watch").is_some_and(|v| v == "true" || v == "1");
        let verb = match (&parts.method, named) {
            (&Method::GET, true) => Verb::Get,
            (&Method::GET, false) if watch => Verb::Watch,
            (&Method::GET, false) => Verb::List,
            (&Method::POST, _) => Verb::Create,
            (&Method::PUT, _) => Verb::Update,
            (&Method::PATCH, _) => Verb::Patch,
            (&Method::DELETE, true) => Verb::Delete,
            _ => Verb::DeleteCollection,
        };
        let ct = content_type.clone().unwrap_or_default();
        let body: Option<Value> = (!bytes.is_empty()).then(|| {
            let parsed = if ct.contains("yaml") {
                serde_yaml::from_slice(bytes).ok()
            } else {
                serde_json::from_slice(bytes).ok()
            };
            parsed.unwrap_or_else(|| Value::String(String::from_utf8_lossy(bytes).into_owned()))
        });
        let route = route.unwrap_or_default();
        let mut record = RecordedRequest {
            method: parts.method.to_string(),
            path: parts.uri.path().to_owned(),
            query: parts.uri.query().unwrap_or_default().to_owned(),
            content_type,
            accept: accept.clone(),
            body: body.clone(),
            status: 0,
            verb,
            group: route.group.clone(),
            resource: route.plural.clone(),
            subresource: route.sub.clone(),
            namespace: route.namespace.clone(),
            name: route.name.clone(),
            warnings: Vec::new(),
        };
        if verb == Verb::Create && route.sub.as_deref() == Some("eviction") {
            self.evictions.push(body.clone().unwrap_or(Value::Null));
        }
        let reply = if route.plural.is_empty() {
            match self.discovery(parts.uri.path()).filter(|_| parts.method == Method::GET) {
                Some(document) => Reply::Json(200, document),
                None => failure(404, "the server could not find the requested resource", None),
            }
        } else if let Some(fault) = self.take_fault(&record) {
            if verb == Verb::Watch && fault == 410 {
                let line = json!({"type": "ERROR", "object": {"kind": "Status", "apiVersion": "v1", "metadata": {},
                    "status": "Failure", "reason": "Expired", "code": 410, "message": "injected fault: too old resource version"}});
                let (tx, rx) = futures::channel::mpsc::unbounded();
                _ = tx.unbounded_send(Bytes::from(format!("{line}\n")));
                Reply::Watch(rx, Duration::from_secs(1))
            } else {
                failure(fault, format!("injected fault: {} answered {fault}", verb.as_str()), None)
            }
        } else {
            let call = Call {
                gr: Gr::new(&route.group, &route.plural),
                route,
                verb,
                query,
                body,
                content_type: ct,
                meta_only: accept.as_ref().is_some_and(|a| a.contains("as=PartialObjectMetadata")),
                table: accept.is_some_and(|a| a.contains("as=Table")),
                user_agent: header(header::USER_AGENT).unwrap_or_default(),
            };
            self.dispatch(&call, &parts.method).unwrap_or_else(|e| e)
        };
        record.warnings = std::mem::take(&mut self.warnings);
        record.status = match &reply {
            Reply::Json(code, _) => *code,
            Reply::Watch(..) => 200,
        };
        self.requests.push(record);
        reply
    }

    fn take_fault(&mut self, request: &RecordedRequest) -> Option<u16> {
        let sub = request.subresource.as_deref();
        let i = self.faults.iter().position(|f| {
            f.verb == request.verb && resource_matches(&f.resource, &request.group, &request.resource, sub)
        })?;
        let fault = &mut self.faults[i];
        let code = fault.code;
        fault.remaining -= 1;
        if fault.remaining == 0 {
            self.faults.remove(i);
        }
        Some(code)
    }

    fn dispatch(&mut self, call: &Call, method: &Method) -> Handled {
        let sub = call.route.sub.as_deref();
        match (call.verb, sub) {
            (_, Some(s)) if s != "status" && !(s == "eviction" && call.verb == Verb::Create) => {
                Err(failure(404, format!("the server could not find the requested resource ({s})"), None))
            }
            (Verb::Get, _) => {
                let object = self
                    .served_one(&call.gr, call.ns(), call.name())
                    .ok_or_else(|| not_found(&call.gr, call.name()))?;
                Ok(Reply::Json(
                    200,
                    match call.printer(self) {
                        Some(printer) => printer.table([&*object], meta_str(&object, "resourceVersion")),
                        None => call.render(&object),
                    },
                ))
            }
            (Verb::List, _) => self.list_call(call),
            (Verb::Watch, _) => self.watch_call(call),
            (Verb::Create, Some("eviction")) => self.evict(call),
            (Verb::Create, None) if call.route.name.is_none() => self.create(call),
            (Verb::Update, _) => self.replace(call),
            (Verb::Patch, _) => self.patch(call),
            (Verb::Delete, None) => self.delete(call),
            (Verb::DeleteCollection, None) if method == Method::DELETE => self.delete_collection(call),
            _ => Err(failure(405, format!("{method} is not supported here"), None)),
        }
    }

    /// apiVersion and kind of the resource addressed (kind "" when the fake has not seen one).
    fn type_meta(&self, call: &Call) -> (String, String) {
        let av = if call.route.group.is_empty() {
            call.route.version.clone()
        } else {
            format!("{}/{}", call.route.group, call.route.version)
        };
        (av, self.info(&call.gr).map(|i| i.kind.clone()).unwrap_or_default())
    }

    fn list_kind(&self, call: &Call) -> (String, String) {
        if call.meta_only {
            return ("meta.k8s.io/v1".into(), "PartialObjectMetadataList".into());
        }
        let (av, kind) = self.type_meta(call);
        (av, format!("{kind}List"))
    }

    fn list_call(&mut self, call: &Call) -> Handled {
        let (labels, fields) = call.selectors()?;
        let objects = self.served(&call.gr, call.route.namespace.as_deref());
        let matching = objects.iter().map(|o| &**o).filter(|o| labels.matches(o) && fields.matches(o));
        if let Some(printer) = call.printer(self) {
            return Ok(Reply::Json(200, printer.table(matching, &self.rv.to_string())));
        }
        let items: Vec<Value> = matching.map(|o| call.render(o)).collect();
        let (av, kind) = self.list_kind(call);
        let list = json!({"apiVersion": av, "kind": kind, "metadata": {"resourceVersion": self.rv.to_string()}, "items": items});
        Ok(Reply::Json(200, list))
    }

    fn watch_call(&mut self, call: &Call) -> Handled {
        let (labels, fields) = call.selectors()?;
        let spec = WatchSpec {
            gr: call.gr.clone(),
            namespace: call.route.namespace.clone(),
            labels,
            fields,
            meta_only: call.meta_only,
            bookmarks: call.flag("allowWatchBookmarks"),
            table: call.printer(self),
        };
        let rv = call.query.get("resourceVersion").cloned().unwrap_or_default();
        let timeout = call.query.get("timeoutSeconds").and_then(|t| t.parse().ok()).unwrap_or(1800);
        let rx = self.open_watch(spec, &rv, call.flag("sendInitialEvents"));
        Ok(Reply::Watch(rx, Duration::from_secs(timeout)))
    }

    fn section(&self, call: &Call) -> Section {
        match (call.route.sub.as_deref(), self.has_status(&call.gr)) {
            (Some("status"), _) => Section::Status,
            (_, true) => Section::Main,
            (_, false) => Section::All,
        }
    }

    /// Validates and stores a new object built by create or by an apply that creates.
    fn finish_create(&mut self, call: &Call, mut object: Value, apply_manager: Option<&str>) -> Handled {
        call.check_namespace(&mut object)?;
        if !is_blank(&object["metadata"]["resourceVersion"]) {
            return Err(failure(500, "resourceVersion should not be set on objects to be created", None));
        }
        if is_blank(&object["metadata"]["name"]) {
            match object["metadata"]["generateName"].as_str().filter(|g| !g.is_empty()).map(str::to_owned) {
                Some(prefix) => object["metadata"]["name"] = Value::String(prefix + &self.new_name_suffix()),
                None => {
                    return Err(failure(422, "metadata.name: Required value: name or generateName is required", None));
                }
            }
        }
        let name = meta_str(&object, "name").to_owned();
        if self.get(&call.gr, call.ns(), &name).is_some() {
            return Err(failure(409, format!("{} \"{name}\" already exists", call.gr), Some(details(&call.gr, &name))));
        }
        let (av, kind) = self.type_meta(call);
        if is_blank(&object["apiVersion"]) {
            object["apiVersion"] = Value::String(av);
        }
        if is_blank(&object["kind"]) && !kind.is_empty() {
            object["kind"] = Value::String(kind);
        }
        if let Some(meta) = object["metadata"].as_object_mut() {
            for key in ["uid", "creationTimestamp", "deletionTimestamp", "deletionGracePeriodSeconds", "selfLink"] {
                meta.remove(key);
            }
        }
        if self.has_status(&call.gr)
            && let Some(o) = object.as_object_mut()
        {
            o.remove("status");
            if call.gr == Gr::new("", "pods") {
                o.insert("status".into(), json!({"phase": "Pending"}));
            }
        }
        if apply_manager.is_none() {
            object["metadata"].as_object_mut().map(|m| m.remove("managedFields"));
            let (manager, av) = (call.manager(), object["apiVersion"].as_str().unwrap_or_default().to_owned());
            let writer = Writer { manager: &manager, section: self.section(call), api_version: &av, time: &now() };
            ssa::record_update(&json!({}), &mut object, &writer);
        }
        self.learn(&call.gr, &object, call.route.namespace.is_some());
        self.default_fields(&call.gr, &mut object);
        if call.dry_run() {
            return Ok(Reply::Json(201, call.render(&object)));
        }
        let created = self.insert_new(&call.gr, object);
        Ok(Reply::Json(201, call.render(&created)))
    }

    fn create(&mut self, call: &Call) -> Handled {
        let object = call.body()?.clone();
        self.finish_create(call, object, None)
    }

    fn live(&self, call: &Call) -> Result<Value, Reply> {
        self.get(&call.gr, call.ns(), call.name()).cloned().ok_or_else(|| not_found(&call.gr, call.name()))
    }

    /// Builds what a write leaves: only `.status` for the status subresource, everything but `.status`
    /// for the main resource when status is a subresource. Managed fields stay the server's.
    fn scoped(&self, call: &Call, live: &Value, written: &Value) -> Value {
        let mut new = match self.section(call) {
            Section::Status => {
                let mut new = live.clone();
                new["status"] = written["status"].clone();
                new
            }
            Section::Main => {
                let mut new = written.clone();
                new["status"] = live["status"].clone();
                new
            }
            Section::All => written.clone(),
        };
        if let Some(o) = new.as_object_mut()
            && o.get("status").is_some_and(Value::is_null)
        {
            o.remove("status");
        }
        new["metadata"]["managedFields"] = live["metadata"]["managedFields"].clone();
        if new["metadata"]["managedFields"].is_null() {
            new["metadata"].as_object_mut().map(|m| m.remove("managedFields"));
        }
        new
    }

    fn write_update(&mut self, call: &Call, live: &Value, mut new: Value) -> Handled {
        let (manager, av) = (call.manager(), live["apiVersion"].as_str().unwrap_or_default().to_owned());
        let writer = Writer { manager: &manager, section: self.section(call), api_version: &av, time: &now() };
        ssa::record_update(live, &mut new, &writer);
        let written = self.update(&call.gr, live, new, call.dry_run());
        Ok(Reply::Json(200, call.render(&written)))
    }

    fn replace(&mut self, call: &Call) -> Handled {
        let mut body = call.body()?.clone();
        let live = self.live(call)?;
        if meta_str(&body, "name") != call.name() {
            let msg = format!(
                "the name of the object ({}) does not match the name on the URL ({})",
                meta_str(&body, "name"),
                call.name()
            );
            return Err(failure(400, msg, None));
        }
        call.check_namespace(&mut body)?;
        let rv = meta_str(&body, "resourceVersion");
        if !rv.is_empty() && rv != meta_str(&live, "resourceVersion") {
            return Err(conflict(&call.gr, call.name(), MODIFIED));
        }
        let new = self.scoped(call, &live, &body);
        self.write_update(call, &live, new)
    }

    fn patch(&mut self, call: &Call) -> Handled {
        let patch = call.body.clone().ok_or_else(|| failure(400, "the patch body is empty", None))?;
        let ct = call.content_type.split(';').next().unwrap_or_default().trim();
        if ct == "application/apply-patch+yaml" {
            return self.apply(call, patch);
        }
        let live = self.live(call)?;
        let mut patched = live.clone();
        match ct {
            "application/merge-patch+json" | "application/strategic-merge-patch+json" => {
                json_patch::merge(&mut patched, &patch)
            }
            "application/json-patch+json" => {
                let ops: json_patch::Patch = serde_json::from_value(patch)
                    .map_err(|e| failure(400, format!("invalid JSON patch: {e}"), None))?;
                json_patch::patch(&mut patched, &ops)
                    .map_err(|e| failure(422, format!("the JSON patch failed: {e}"), None))?;
            }
            other => {
                return Err(failure(415, format!("the body of the request was in an unknown format: {other}"), None));
            }
        }
        if meta_str(&patched, "resourceVersion") != meta_str(&live, "resourceVersion") {
            return Err(conflict(&call.gr, call.name(), MODIFIED));
        }
        let new = self.scoped(call, &live, &patched);
        self.write_update(call, &live, new)
    }

    /// Server-side apply (see the crate docs for what is modelled).
    fn apply(&mut self, call: &Call, config: Value) -> Handled {
        let Some(manager) = call.query.get("fieldManager").filter(|m| !m.is_empty()) else {
            return Err(failure(
                422,
                "PatchOptions.meta.k8s.io \"\" is invalid: fieldManager: Required value: is required for apply patch",
                None,
            ));
        };
        if !config.is_object() {
            return Err(failure(400, "the applied configuration is not an object", None));
        }
        let name = meta_str(&config, "name");
        if !name.is_empty() && name != call.name() {
            return Err(failure(
                400,
                format!("the name of the object ({name}) does not match the name on the URL ({})", call.name()),
                None,
            ));
        }
        let section = self.section(call);
        let mut scoped = json!({"metadata": {}});
        for (k, v) in config.as_object().into_iter().flatten() {
            let keep = match k.as_str() {
                "apiVersion" | "kind" => false,
                "metadata" => {
                    for m in ["labels", "annotations", "finalizers", "ownerReferences"] {
                        if section != Section::Status && !v[m].is_null() {
                            scoped["metadata"][m] = v[m].clone();
                        }
                    }
                    false
                }
                "status" => section != Section::Main,
                _ => section != Section::Status,
            };
            if keep {
                scoped[k] = v.clone();
            }
        }
        let existing = self.get(&call.gr, call.ns(), call.name()).cloned();
        // A `metadata.uid` in the configuration is a precondition, as the API server's update makes it.
        let uid = meta_str(&config, "uid");
        if let Some(live) = existing.as_ref().filter(|l| !uid.is_empty() && meta_str(l, "uid") != uid) {
            let why = format!(
                "Precondition failed: UID in precondition: {uid}, UID in object meta: {}",
                meta_str(live, "uid")
            );
            return Err(conflict(&call.gr, call.name(), &why));
        }
        let rv = meta_str(&config, "resourceVersion");
        if !rv.is_empty() && existing.as_ref().is_none_or(|l| meta_str(l, "resourceVersion") != rv) {
            return Err(conflict(&call.gr, call.name(), MODIFIED));
        }
        if existing.is_none() && section == Section::Status {
            return Err(not_found(&call.gr, call.name()));
        }
        let mut new = existing.clone().unwrap_or_else(|| {
            json!({"apiVersion": config["apiVersion"], "kind": config["kind"],
                   "metadata": {"name": call.name(), "namespace": call.route.namespace}})
        });
        if new["metadata"]["namespace"].is_null() {
            new["metadata"].as_object_mut().map(|m| m.remove("namespace"));
        }
        let av = config["apiVersion"].as_str().unwrap_or_default().to_owned();
        let writer = Writer { manager, section, api_version: &av, time: &now() };
        if let Err(conflicts) = ssa::apply(&mut new, &scoped, &writer, call.flag("force")) {
            let causes: Vec<Value> = conflicts
                .iter()
                .map(|(m, f)| json!({"reason": "FieldManagerConflict", "message": format!("conflict with \"{m}\""), "field": f}))
                .collect();
            let listed: Vec<String> = conflicts.iter().map(|(m, f)| format!("conflict with \"{m}\": {f}")).collect();
            let msg = format!("Apply failed with {} conflict(s): {}", conflicts.len(), listed.join("; "));
            let mut d = details(&call.gr, call.name());
            d["causes"] = Value::Array(causes);
            return Err(failure(409, msg, Some(d)));
        }
        match existing {
            None => self.finish_create(call, new, Some(manager)),
            Some(live) => {
                let written = self.update(&call.gr, &live, new, call.dry_run());
                Ok(Reply::Json(200, call.render(&written)))
            }
        }
    }

    fn check_preconditions(call: &Call, live: &Value, options: &Value) -> Result<(), Reply> {
        for (key, label) in [("uid", "UID"), ("resourceVersion", "ResourceVersion")] {
            let wanted = options["preconditions"][key].as_str().unwrap_or_default();
            let actual = meta_str(live, key);
            if !wanted.is_empty() && wanted != actual {
                let why =
                    format!("Precondition failed: {label} in precondition: {wanted}, {label} in object meta: {actual}");
                return Err(conflict(&call.gr, call.name(), &why));
            }
        }
        Ok(())
    }

    /// Deletes `live`, or marks it terminating (finalizers, graceful pods). Returns the last state and
    /// whether the object is still there.
    pub(crate) fn remove_object(&mut self, gr: &Gr, live: &Value, grace: Option<i64>, dry_run: bool) -> (Value, bool) {
        let pod = gr.plural == "pods" && gr.group.is_empty();
        let has_finalizers = live["metadata"]["finalizers"].as_array().is_some_and(|f| !f.is_empty());
        if !live["metadata"]["deletionTimestamp"].is_null() {
            if pod && grace == Some(0) && !has_finalizers && !dry_run {
                return (self.commit(gr, live.clone(), Change::Deleted), false);
            }
            return (live.clone(), true);
        }
        let grace = match (pod && self.graceful_pods, grace) {
            (true, Some(g)) => g,
            (true, None) => live["spec"]["terminationGracePeriodSeconds"].as_i64().unwrap_or(30),
            (false, _) => 0,
        };
        match (grace > 0 || has_finalizers, dry_run) {
            (_, true) => (live.clone(), grace > 0 || has_finalizers),
            (true, false) => (self.mark_terminating(gr, live, grace), true),
            (false, false) => (self.commit(gr, live.clone(), Change::Deleted), false),
        }
    }

    fn delete(&mut self, call: &Call) -> Handled {
        let live = self.live(call)?;
        let options = call.body.clone().unwrap_or(Value::Null);
        Self::check_preconditions(call, &live, &options)?;
        let (last, present) =
            self.remove_object(&call.gr, &live, options["gracePeriodSeconds"].as_i64(), call.dry_run());
        if present || call.gr.plural == "pods" {
            return Ok(Reply::Json(200, call.render(&last)));
        }
        let mut d = details(&call.gr, call.name());
        d["uid"] = live["metadata"]["uid"].clone();
        Ok(success(200, Some(d)))
    }

    fn delete_collection(&mut self, call: &Call) -> Handled {
        let (labels, fields) = call.selectors()?;
        let grace = call.body.as_ref().and_then(|b| b["gracePeriodSeconds"].as_i64());
        let matching: Vec<Value> = self
            .list(&call.gr, call.route.namespace.as_deref())
            .into_iter()
            .filter(|o| labels.matches(o) && fields.matches(o))
            .cloned()
            .collect();
        let items: Vec<Value> =
            matching.iter().map(|o| call.render(&self.remove_object(&call.gr, o, grace, call.dry_run()).0)).collect();
        let (av, kind) = self.list_kind(call);
        Ok(Reply::Json(
            200,
            json!({"apiVersion": av, "kind": kind, "metadata": {"resourceVersion": self.rv.to_string()}, "items": items}),
        ))
    }

    fn evict(&mut self, call: &Call) -> Handled {
        if call.gr != Gr::new("", "pods") {
            return Err(failure(404, "the server could not find the requested resource", None));
        }
        let body = call.body()?.clone();
        // Like the real server (fieldValidation=Warn by default), unknown fields are ignored with a warning.
        for key in body.as_object().into_iter().flatten().map(|(k, _)| k) {
            if !matches!(key.as_str(), "apiVersion" | "kind" | "metadata" | "deleteOptions") {
                self.warnings.push(format!("unknown field \"{key}\""));
            }
        }
        let live = self.live(call)?;
        let blocked = match self.eviction_block {
            Some(EvictionBlock::Always) => true,
            Some(EvictionBlock::Next(n)) => {
                self.eviction_block = (n > 1).then(|| EvictionBlock::Next(n - 1));
                true
            }
            None => false,
        };
        if blocked {
            let mut d = details(&call.gr, call.name());
            d["causes"] = json!([{"reason": "DisruptionBudget", "message": "The disruption budget fake-pdb needs 1 healthy pods and has 1 currently"}]);
            return Err(failure(429, "Cannot evict pod as it would violate the pod's disruption budget.", Some(d)));
        }
        if !live["metadata"]["deletionTimestamp"].is_null() {
            return Ok(success(201, None));
        }
        let options = &body["deleteOptions"];
        Self::check_preconditions(call, &live, options)?;
        if call.dry_run() {
            return Ok(success(201, None));
        }
        let mut with_condition = live.clone();
        let condition = json!({"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI",
                               "message": "Eviction API: evicting", "lastTransitionTime": now()});
        let mut conditions = with_condition["status"]["conditions"].as_array().cloned().unwrap_or_default();
        conditions.retain(|c| c["type"] != "DisruptionTarget");
        conditions.push(condition);
        with_condition["status"]["conditions"] = Value::Array(conditions);
        let live = self.update(&call.gr, &live, with_condition, false);
        self.remove_object(&call.gr, &live, options["gracePeriodSeconds"].as_i64(), false);
        Ok(success(201, None))
    }
}

/// A response body: one JSON document, or the lines of a watch until it times out or is disconnected.
#[derive(Debug)]
pub struct ResponseBody {
    kind: BodyKind,
}

#[derive(Debug)]
enum BodyKind {
    Full(Option<Bytes>),
    Stream(UnboundedReceiver<Bytes>, Pin<Box<tokio::time::Sleep>>),
}

impl ResponseBody {
    pub(crate) fn from_reply(reply: Reply) -> Response<ResponseBody> {
        let (status, kind) = match reply {
            Reply::Json(code, v) => (code, BodyKind::Full(Some(Bytes::from(v.to_string())))),
            Reply::Watch(rx, timeout) => (200, BodyKind::Stream(rx, Box::pin(tokio::time::sleep(timeout)))),
        };
        let mut response = Response::new(ResponseBody { kind });
        *response.status_mut() = http::StatusCode::from_u16(status).unwrap_or(http::StatusCode::INTERNAL_SERVER_ERROR);
        response.headers_mut().insert(header::CONTENT_TYPE, http::HeaderValue::from_static("application/json"));
        response
    }
}

impl http_body::Body for ResponseBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        match &mut self.get_mut().kind {
            BodyKind::Full(bytes) => Poll::Ready(bytes.take().map(|b| Ok(Frame::data(b)))),
            BodyKind::Stream(rx, deadline) => {
                if deadline.as_mut().poll(cx).is_ready() {
                    return Poll::Ready(None);
                }
                rx.poll_next_unpin(cx).map(|line| line.map(|l| Ok(Frame::data(l))))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        matches!(self.kind, BodyKind::Full(None))
    }
}

/// The answer to a request as the fake would give it, used by the tower service.
pub(crate) fn respond(state: &mut State, request: Request<Bytes>) -> Response<ResponseBody> {
    let (parts, bytes) = request.into_parts();
    let mut response = ResponseBody::from_reply(state.handle(&parts, &bytes));
    for warning in state.requests.last().map(|r| r.warnings.as_slice()).unwrap_or_default() {
        if let Ok(value) = http::HeaderValue::from_str(&format!("299 - {warning:?}")) {
            response.headers_mut().append(header::WARNING, value);
        }
    }
    response
}
