{{- define "pdserve.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "pdserve.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "pdserve.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "pdserve.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "pdserve.secretName" -}}
{{- .Values.clusterSecret.existingSecret | default (printf "%s-cluster-secret" (include "pdserve.fullname" .)) -}}
{{- end -}}

{{/* Replaced by the head pod's IP at start: pdserve joins Ray and serves KV from it. */}}
{{- define "pdserve.podIpPlaceholder" -}}__POD_IP__{{- end -}}

{{/* GPUs each rank of a pdserve worker takes (pools.gpus_per_worker): the decode group's
GPUs per worker over its tensor-parallel size. */}}
{{- define "pdserve.gpusPerWorker" -}}
{{- $d := .Values.decode -}}
{{- $p := .Values.prefill -}}
{{- $tp := (((.Values.config.engine).parallel).tensor_parallel_size) | default 1 -}}
{{- $dtp := .Values.config.pools.decode_tp | default $tp -}}
{{- $ptp := .Values.config.pools.prefill_tp | default $tp -}}
{{- $perRank := divf $d.gpus (mul $d.workersPerPod $dtp) -}}
{{- if and (eq .Values.config.pools.mode "disaggregated") (ne (divf $p.gpus (mul $p.workersPerPod $ptp)) $perRank) -}}
{{- fail (printf "prefill.gpus/(prefill.workersPerPod x prefill TP) (%v/(%v x %v)) must equal decode.gpus/(decode.workersPerPod x decode TP) (%v/(%v x %v)): pdserve gives every rank the same GPUs" $p.gpus $p.workersPerPod $ptp $d.gpus $d.workersPerPod $dtp) -}}
{{- end -}}
{{- $perRank -}}
{{- end -}}

{{/* A worker group's pod bounds under autoscaling (null: its replicas). */}}
{{- define "pdserve.minReplicas" -}}
{{- if kindIs "invalid" .minReplicas }}{{ .replicas }}{{ else }}{{ .minReplicas }}{{ end -}}
{{- end -}}
{{- define "pdserve.maxReplicas" -}}
{{- if kindIs "invalid" .maxReplicas }}{{ .replicas }}{{ else }}{{ .maxReplicas }}{{ end -}}
{{- end -}}

{{/* The pdserve config file: values.config plus what the pods decide. */}}
{{- define "pdserve.config" -}}
{{- $cfg := deepCopy .Values.config -}}
{{- $pools := get $cfg "pools" -}}
{{- $disaggregated := eq $pools.mode "disaggregated" -}}
{{- $_ := set $pools "num_decode" (mul .Values.decode.replicas .Values.decode.workersPerPod) -}}
{{- $_ := set $pools "num_prefill" (ternary (mul .Values.prefill.replicas .Values.prefill.workersPerPod) 0 $disaggregated) -}}
{{- $_ := set $pools "gpus_per_worker" (include "pdserve.gpusPerWorker" . | float64) -}}
{{- $planner := get $pools "planner" | default dict -}}
{{- if and .Values.autoscaling.enabled $planner (not $planner.max_workers) -}}
{{- $maxPrefill := ternary (mul (include "pdserve.maxReplicas" .Values.prefill | int) .Values.prefill.workersPerPod) 0 $disaggregated -}}
{{- $_ := set $planner "max_workers" (add $maxPrefill (mul (include "pdserve.maxReplicas" .Values.decode | int) .Values.decode.workersPerPod)) -}}
{{- end -}}
{{- $_ := set $pools "prefill_resource" "prefill" -}}
{{- $_ := set $pools "decode_resource" "decode" -}}
{{- $_ := set (get $cfg "server") "host" "0.0.0.0" -}}
{{- if .Values.auth.tlsSecret -}}
{{- $_ := set (get $cfg "server") "tls_cert" "/etc/pdserve-tls/tls.crt" -}}
{{- $_ := set (get $cfg "server") "tls_key" "/etc/pdserve-tls/tls.key" -}}
{{- end -}}
{{- if .Values.auth.clientCaSecret -}}
{{- if not .Values.auth.tlsSecret -}}
{{- fail "auth.clientCaSecret (client certificates, mutual TLS) needs auth.tlsSecret: the server's own TLS" -}}
{{- end -}}
{{- $_ := set (get $cfg "server") "tls_client_ca" (printf "/etc/pdserve-client-ca/%s" .Values.auth.clientCaSecretKey) -}}
{{- end -}}
{{- if .Values.auth.apiKeySecret -}}
{{- $_ := set (get $cfg "server") "api_key_file" (printf "/etc/pdserve-api-key/%s" .Values.auth.apiKeySecretKey) -}}
{{- end -}}
{{- if .Values.auth.adminTokenSecret -}}
{{- $_ := set (get $cfg "server") "admin_token_file" (printf "/etc/pdserve-admin-token/%s" .Values.auth.adminTokenSecretKey) -}}
{{- end -}}
{{- if .Values.auth.tenantsSecret -}}
{{- if (get $cfg "server").tenants_file -}}
{{- fail "config.server.tenants_file and auth.tenantsSecret both name the tenants file: give one" -}}
{{- end -}}
{{- $_ := set (get $cfg "server") "tenants_file" (printf "/etc/pdserve-tenants/%s" .Values.auth.tenantsSecretKey) -}}
{{- end -}}
{{- /* the head's process: the control plane and one frontend (frontends.enabled), else the whole server */ -}}
{{- $_ := set (get $cfg "server") "control_plane" .Values.frontends.enabled -}}
{{- $_ := set (get $cfg "server") "frontends" 1 -}}
{{- $_ := set $cfg "ray" (dict "address" "auto" "node_ip_address" (include "pdserve.podIpPlaceholder" .) "namespace" "pdserve") -}}
{{- toYaml $cfg -}}
{{- end -}}

{{/* Ray custom resources of a worker group, as rayStartParams wants them: a quoted JSON string. */}}
{{- define "pdserve.rayResources" -}}
{{- printf "%q" (dict .name .group.workersPerPod | toJson) -}}
{{- end -}}

{{- define "pdserve.workerGroup" -}}
{{- $root := .root -}}
{{- $group := .group -}}
- groupName: {{ .name }}
  replicas: {{ $group.replicas }}
  {{- if $root.Values.autoscaling.enabled }}
  minReplicas: {{ include "pdserve.minReplicas" $group }}
  maxReplicas: {{ include "pdserve.maxReplicas" $group }}
  {{- else }}
  minReplicas: {{ $group.replicas }}
  maxReplicas: {{ $group.replicas }}
  {{- end }}
  rayStartParams:
    resources: {{ include "pdserve.rayResources" . | quote }}
    num-gpus: {{ $group.gpus | quote }}
  template:
    metadata:
      labels:
        {{- include "pdserve.selectorLabels" $root | nindent 8 }}
        app.kubernetes.io/component: {{ .name }}
    spec:
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets: {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $group.nodeSelector }}
      nodeSelector: {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $group.tolerations }}
      tolerations: {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $group.affinity }}
      affinity: {{- toYaml . | nindent 8 }}
      {{- end }}
      containers:
        - name: ray-worker
          image: {{ include "pdserve.image" $root }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          # ray.io/overwrite-container-cmd: KubeRay leaves the command to us and
          # puts its generated `ray start ... --block` in $KUBERAY_GEN_RAY_START_CMD.
          command: ["/bin/bash", "-lc", "--"]
          args: ["ulimit -n 65536; eval \"$KUBERAY_GEN_RAY_START_CMD\""]
          env:
            - name: PDSERVE_CACHE_DIR
              value: {{ $root.Values.config.engine.model.cache_dir | quote }}
            {{- with $root.Values.extraEnv }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          resources:
            requests:
              {{- with $group.resources.requests }}{{ toYaml . | nindent 14 }}{{- end }}
              {{- if gt (int $group.gpus) 0 }}
              nvidia.com/gpu: {{ $group.gpus }}
              {{- end }}
            limits:
              {{- with $group.resources.limits }}{{ toYaml . | nindent 14 }}{{- end }}
              {{- if gt (int $group.gpus) 0 }}
              nvidia.com/gpu: {{ $group.gpus }}
              {{- end }}
          volumeMounts:
            - name: model-cache
              mountPath: {{ $root.Values.config.engine.model.cache_dir }}
            - name: dshm
              mountPath: /dev/shm
            {{- with $root.Values.extraVolumeMounts }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
      volumes:
        - name: model-cache
          emptyDir: {}
        - name: dshm  # Ray's object store and the shm KV transport
          emptyDir: {medium: Memory}
        {{- with $root.Values.extraVolumes }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
{{- end -}}
