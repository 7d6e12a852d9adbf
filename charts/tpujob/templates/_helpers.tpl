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

{{/* TPU chips on one host of a slice shape (dict: accelerator, topology), as operator/src/tpujob_operator/tpu.py
     derives them (tests/integration/test_helm.py compares the two on every shape): single-host shapes put every
     chip on one host (up to 8 on v5e and v6e, 4 on v4 and v5p), multi-host ones 4 per host. */}}
{{- define "tpujob.chipsPerHost" -}}
{{- $single := dict "tpu-v4-podslice" 4 "tpu-v5p-slice" 4 "tpu-v5-lite-podslice" 8 "tpu-v6e-slice" 8 -}}
{{- if not (hasKey $single .accelerator) -}}
{{- fail (printf "spares.pools: accelerator %q is not one of %s" .accelerator (keys $single | sortAlpha | join ", ")) -}}
{{- end -}}
{{- $chips := 1 -}}
{{- range splitList "x" (toString .topology) -}}
{{- $chips = mul $chips (atoi .) -}}
{{- end -}}
{{- if or (lt (int $chips) 1) (not (regexMatch "^[0-9]+(x[0-9]+){1,2}$" (toString .topology))) -}}
{{- fail (printf "spares.pools: topology %q is not a TPU topology such as 2x2 or 2x2x2" (toString .topology)) -}}
{{- end -}}
{{- if le (int $chips) (int (get $single .accelerator)) }}{{ $chips }}{{ else }}4{{ end -}}
{{- end -}}
