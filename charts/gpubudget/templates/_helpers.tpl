{{/* Names, labels, images, and the checks values.schema.json cannot express. */}}

{{- define "gpubudget.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "gpubudget.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "gpubudget.agent.fullname" -}}
{{- printf "%s-agent" (include "gpubudget.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "gpubudget.operator.fullname" -}}
{{- printf "%s-operator" (include "gpubudget.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "gpubudget.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "gpubudget.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: gpubudget
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Selector labels of one component: include with (dict "ctx" $ "component" "agent"). */}}
{{- define "gpubudget.selectorLabels" -}}
app.kubernetes.io/name: {{ include "gpubudget.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "gpubudget.componentLabels" -}}
{{ include "gpubudget.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "gpubudget.agent.serviceAccountName" -}}
{{- if .Values.agent.serviceAccount.create -}}
{{- default (include "gpubudget.agent.fullname" .) .Values.agent.serviceAccount.name -}}
{{- else -}}
{{- required "agent.serviceAccount.name is required when agent.serviceAccount.create is false" .Values.agent.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "gpubudget.operator.serviceAccountName" -}}
{{- if .Values.operator.serviceAccount.create -}}
{{- default (include "gpubudget.operator.fullname" .) .Values.operator.serviceAccount.name -}}
{{- else -}}
{{- required "operator.serviceAccount.name is required when operator.serviceAccount.create is false" .Values.operator.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The user name the API server gives the agent's service account (admission matches on it). */}}
{{- define "gpubudget.agent.username" -}}
{{- printf "system:serviceaccount:%s:%s" .Release.Namespace (include "gpubudget.agent.serviceAccountName" .) -}}
{{- end -}}

{{/* Image reference: include with (dict "ctx" $ "image" .Values.agent.image). */}}
{{- define "gpubudget.image" -}}
{{- $registry := .ctx.Values.image.registry | trimSuffix "/" -}}
{{- $repo := .image.repository -}}
{{- if $registry }}{{ $repo = printf "%s/%s" $registry $repo }}{{ end -}}
{{- if .image.digest -}}
{{- printf "%s@%s" $repo .image.digest -}}
{{- else -}}
{{- printf "%s:%s" $repo (default .ctx.Chart.AppVersion .image.tag) -}}
{{- end -}}
{{- end -}}

{{/* Whether the operator runs leader election: "true" or "false". */}}
{{- define "gpubudget.operator.leaderElection" -}}
{{- $mode := .Values.operator.leaderElection.mode -}}
{{- if eq $mode "always" -}}true
{{- else if eq $mode "never" -}}false
{{- else if gt (int .Values.operator.replicas) 1 -}}true
{{- else -}}false
{{- end -}}
{{- end -}}

{{- define "gpubudget.metricsService" -}}
{{- if or .Values.metrics.service.enabled .Values.metrics.serviceMonitor.enabled -}}true{{- end -}}
{{- end -}}

{{/* Webhook serving certificate: the Secret, the Service DNS name, and the CA bundle. */}}
{{- define "gpubudget.webhook.secretName" -}}
{{- printf "%s-webhook-tls" (include "gpubudget.operator.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "gpubudget.webhook.serviceName" -}}
{{- printf "%s-webhook" (include "gpubudget.operator.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
Cross-field checks, with messages that say what to change. values.schema.json checks each value alone.
*/}}
{{- define "gpubudget.validate" -}}
{{- include "gpubudget.oneReleasePerCluster" . -}}
{{- if and (gt (int .Values.operator.replicas) 1) (eq .Values.operator.leaderElection.mode "never") -}}
{{- fail (printf "operator.replicas is %v but operator.leaderElection.mode is \"never\": two operators without leader election would both write status. Use mode auto or always, or one replica." .Values.operator.replicas) -}}
{{- end -}}
{{- if and .Values.agent.replaySample.enabled (not .Values.agent.replaySample.configMap) (not .Values.agent.replaySample.content) -}}
{{- fail "agent.replaySample.enabled is true but neither agent.replaySample.configMap (an existing ConfigMap) nor agent.replaySample.content (the file) is set." -}}
{{- end -}}
{{- if and .Values.nodeRestriction.enabled .Values.nodeRestriction.webhook.certManager.enabled .Values.nodeRestriction.webhook.certManager.issuerRef -}}
{{- if not .Values.nodeRestriction.webhook.certManager.issuerRef.name -}}
{{- fail "nodeRestriction.webhook.certManager.issuerRef needs a name (or leave it {} for the chart's self-signed Issuer)." -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
One release per cluster (issue 43): the admission policies are cluster-wide and each admits only its own release's
agent, so a second release would refuse the first one's records (and both agents would write the same nodes'
GpuNodeUsage). At install or upgrade, any gpubudget ValidatingAdmissionPolicy or ClusterRole (label
app.kubernetes.io/part-of=gpubudget) of another release (Helm's meta.helm.sh/release-name and release-namespace
annotations; without them, as `helm template | kubectl apply` leaves them, the app.kubernetes.io/instance label)
fails it, naming that release. `lookup` is empty without a cluster (helm template, lint, --dry-run): nothing then.
*/}}
{{- define "gpubudget.oneReleasePerCluster" -}}
{{- $found := list -}}
{{- if .Capabilities.APIVersions.Has "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy" -}}
{{- $found = concat $found ((lookup "admissionregistration.k8s.io/v1" "ValidatingAdmissionPolicy" "" "").items | default list) -}}
{{- end -}}
{{- $found = concat $found ((lookup "rbac.authorization.k8s.io/v1" "ClusterRole" "" "").items | default list) -}}
{{- range $obj := $found -}}
{{- $labels := $obj.metadata.labels | default dict -}}
{{- if eq (get $labels "app.kubernetes.io/part-of") "gpubudget" -}}
{{- $annotations := $obj.metadata.annotations | default dict -}}
{{- $release := get $annotations "meta.helm.sh/release-name" | default (get $labels "app.kubernetes.io/instance") -}}
{{- $namespace := get $annotations "meta.helm.sh/release-namespace" -}}
{{- if or (ne $release $.Release.Name) (and $namespace (ne $namespace $.Release.Namespace)) -}}
{{- fail (printf "gpubudget is already installed in this cluster: %s %s belongs to release %q in namespace %q. One release per cluster: its admission policies are cluster-wide and admit only its own agent, so a second release would refuse the first one's records. Upgrade that release (helm upgrade %s -n %s), or uninstall it first (docs/operations.md, \"One release per cluster\")." $obj.kind $obj.metadata.name $release (default "unknown (applied without Helm)" $namespace) $release (default "NAMESPACE" $namespace)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
The Lease by which the operator's leader vouches that every budget has a current mirror (the agents read the
mirrors only while it is renewed).
*/}}
{{- define "gpubudget.mirrorsLease" -}}
{{- printf "%s-mirrors" (include "gpubudget.operator.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* A list of strings as a CEL list literal: ['a', 'b']. The strings must hold no quote, backslash or line break. */}}
{{- define "gpubudget.celList" -}}
[{{ range $i, $s := . }}{{ if $i }}, {{ end }}'{{ $s }}'{{ end }}]
{{- end }}
