{{- define "tpujob.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "tpujob.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "tpujob.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "tpujob.serviceAccountName" -}}
{{- default (include "tpujob.fullname" .) .Values.serviceAccount.name -}}
{{- end -}}

{{- define "tpujob.leaseNamespace" -}}
{{- default .Release.Namespace .Values.leaderElection.namespace -}}
{{- end -}}

{{/* policy.allowedCheckpointLocations, checked and without trailing slashes (the operator's form). */}}
{{- define "tpujob.checkpointLocations" -}}
{{- $out := list -}}
{{- range .Values.policy.allowedCheckpointLocations -}}
{{- $loc := trimSuffix "/" (trim .) -}}
{{- if or (not (hasPrefix "gs://" $loc)) (eq $loc "gs:/") (eq $loc "gs://") (hasPrefix "gs:///" $loc) -}}
{{- fail (printf "policy.allowedCheckpointLocations: %q must be gs://bucket or gs://bucket/prefix" .) -}}
{{- end -}}
{{- $out = append $out $loc -}}
{{- end -}}
{{- join " " $out -}}
{{- end -}}

{{/* The ClusterRole of JobSet's in-place restart agent (rbac.yaml), passed to the operator. */}}
{{- define "tpujob.inPlaceAgentRole" -}}
{{ include "tpujob.fullname" . }}-in-place-restart-agent
{{- end }}
