#!/usr/bin/env python3
"""Validates every manifest in deploy/ offline.

    python3 deploy/validate.py [--k8s 1.37.0,1.30.0] [FILES...]

Needs the PyPI packages kubernetes-validate (it bundles Kubernetes' OpenAPI
schemas as JSON schemas, up to the release of its own version number), which
brings jsonschema and PyYAML. Checks:

1. core objects (ConfigMap, Service, Job, DaemonSet, ...) against Kubernetes'
   schema of each version given, strict: an unknown or misspelt field fails;
   a kind without a schema fails too (never skipped);
2. NetworkAttachmentDefinitions against the CRD's own openAPIV3Schema
   (schemas/network-attachment-definition-crd.yaml, provenance there), and the
   CNI configuration inside spec.config: JSON, cniVersion, name, a type or a
   plugins list whose entries have types;
3. the RDMA shared device plugin's config.json against
   schemas/rdma-shared-dev-plugin-config.schema.json, resource names unique;
4. what the schemas cannot say, checked across files: every container that
   takes an RDMA device (rdma/* or an *rdma* VF resource) has IPC_LOCK, none is
   privileged or mounts /dev/infiniband from the host (the device plugin brings
   the files); every rdma/<name> requested is a resource the ConfigMap defines;
   every Multus network a pod names is defined here; a pod that sources
   /fabric/env.sh mounts the volume an init container writes it to.
Exit status 0 when everything passes, 1 otherwise.
"""
import argparse
import glob
import json
import os
import sys

import jsonschema
import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
NAD_KIND = ("k8s.cni.cncf.io/v1", "NetworkAttachmentDefinition")


def load_docs(paths):
    out = []
    for p in paths:
        with open(p) as f:
            for d in yaml.safe_load_all(f):
                if d:
                    out.append((os.path.basename(p), d))
    return out


def nad_schema():
    with open(os.path.join(HERE, "schemas", "network-attachment-definition-crd.yaml")) as f:
        crd = yaml.safe_load(f)
    (v,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return v["schema"]["openAPIV3Schema"]


def check_cni(conf):
    """Errors in one CNI network configuration (a string)."""
    try:
        c = json.loads(conf)
    except ValueError as e:
        return [f"spec.config is not JSON: {e}"]
    errs = []
    for k in ("cniVersion", "name"):
        if not isinstance(c.get(k), str) or not c.get(k):
            errs.append(f"spec.config lacks {k}")
    if "plugins" in c:
        if not isinstance(c["plugins"], list) or not c["plugins"]:
            errs.append("spec.config plugins must be a non-empty list")
        else:
            errs += [f"spec.config plugins[{i}] lacks type" for i, p in enumerate(c["plugins"]) if not p.get("type")]
    elif not c.get("type"):
        errs.append("spec.config has neither type nor plugins")
    return errs


def pod_specs(doc):
    k = doc.get("kind")
    spec = doc.get("spec") or {}
    if k == "Pod":
        return [(doc.get("metadata") or {}, spec)]
    if k in ("Job", "DaemonSet", "Deployment", "StatefulSet", "ReplicaSet"):
        t = spec.get("template") or {}
        return [(t.get("metadata") or {}, t.get("spec") or {})]
    return []


def cross_checks(docs):
    errs = []
    rdma_names, nads = set(), set()
    for _, d in docs:
        if (d.get("apiVersion"), d.get("kind")) == NAD_KIND:
            nads.add(d["metadata"]["name"])
        if d.get("kind") == "ConfigMap" and "config.json" in (d.get("data") or {}):
            try:
                for c in json.loads(d["data"]["config.json"]).get("configList", []):
                    rdma_names.add("rdma/" + c.get("resourceName", ""))
            except ValueError:
                pass
    for f, d in docs:
        for meta, spec in pod_specs(d):
            where = f"{f}: {d['kind']}/{d['metadata']['name']}"
            nets = (meta.get("annotations") or {}).get("k8s.v1.cni.cncf.io/networks", "")
            for n in [x.strip().split("@")[0].split("/")[-1] for x in nets.split(",") if x.strip()]:
                if n not in nads:
                    errs.append(f"{where}: network {n!r} is not a NetworkAttachmentDefinition in deploy/")
            vols = {v["name"]: v for v in spec.get("volumes") or []}
            for v in vols.values():
                hp = (v.get("hostPath") or {}).get("path", "")
                if hp.startswith("/dev/infiniband"):
                    errs.append(f"{where}: volume {v['name']} mounts {hp} from the host; request the RDMA resource instead")
            writers = {}
            for c in spec.get("initContainers") or []:
                script = " ".join(c.get("command") or []) + " " + " ".join(c.get("args") or [])
                if "/fabric/env.sh" in script:
                    for m in c.get("volumeMounts") or []:
                        if m["mountPath"] == "/fabric":
                            writers[m["name"]] = c["name"]
            for c in (spec.get("initContainers") or []) + (spec.get("containers") or []):
                cw = f"{where} container {c['name']}"
                lim = {**((c.get("resources") or {}).get("requests") or {}), **((c.get("resources") or {}).get("limits") or {})}
                rdma = [r for r in lim if r.startswith("rdma/") or "rdma" in r.split("/")[-1]]
                sc = c.get("securityContext") or {}
                caps = set(((sc.get("capabilities") or {}).get("add")) or [])
                if rdma and not ({"IPC_LOCK", "CAP_IPC_LOCK"} & caps):
                    errs.append(f"{cw}: takes {rdma} but lacks capabilities.add IPC_LOCK (verbs registrations pin memory)")
                if sc.get("privileged"):
                    errs.append(f"{cw}: privileged; IPC_LOCK and the RDMA resource are all librustnet needs")
                for r in lim:
                    if r.startswith("rdma/") and r not in rdma_names:
                        errs.append(f"{cw}: requests {r}, which the RDMA shared device plugin ConfigMap does not define ({sorted(rdma_names)})")
                script = " ".join(c.get("command") or [])
                if ". /fabric/env.sh" in script:
                    mounts = {m["name"] for m in c.get("volumeMounts") or [] if m["mountPath"] == "/fabric"}
                    if not mounts & set(writers):
                        errs.append(f"{cw}: sources /fabric/env.sh but no init container writes it to a volume mounted here")
    return errs


def main(argv=None):
    ap = argparse.ArgumentParser(description="validate deploy/ manifests offline")
    ap.add_argument("--k8s", default=None, help="comma-separated Kubernetes versions (default: the newest bundled and 1.30.0)")
    ap.add_argument("files", nargs="*")
    a = ap.parse_args(argv)
    import kubernetes_validate as kv
    from kubernetes_validate import utils as kvu

    versions = a.k8s.split(",") if a.k8s else [kvu.latest_version(), "1.30.0"]
    files = a.files or sorted(glob.glob(os.path.join(HERE, "*.yaml")))
    docs = load_docs(files)
    fails = 0
    nad = nad_schema()
    with open(os.path.join(HERE, "schemas", "rdma-shared-dev-plugin-config.schema.json")) as f:
        rdma_schema = json.load(f)

    def report(ok, what, why=""):
        nonlocal fails
        fails += 0 if ok else 1
        print(f"{'PASS' if ok else 'FAIL'} {what}{': ' + why if why else ''}")

    for f, d in docs:
        what = f"{f} {d.get('kind')}/{(d.get('metadata') or {}).get('name')}"
        if (d.get("apiVersion"), d.get("kind")) == NAD_KIND:
            e = sorted(jsonschema.Draft7Validator(nad).iter_errors(d), key=str)
            cni = check_cni((d.get("spec") or {}).get("config", "{}")) if not e else []
            report(not e and not cni, f"{what} against the NetworkAttachmentDefinition CRD schema + CNI config",
                   "; ".join([x.message for x in e] + cni))
            continue
        for v in versions:
            try:
                kv.validate(d, v, strict=True)
                report(True, f"{what} against Kubernetes {kvu.major_minor(v)} (strict)")
            except kv.SchemaNotFoundError as e:
                report(False, f"{what} against Kubernetes {kvu.major_minor(v)}", f"no schema: {e}")
            except kv.ValidationError as e:
                report(False, f"{what} against Kubernetes {kvu.major_minor(v)} (strict)", f"{e.message} at {'/'.join(map(str, e.path))}")
        if d.get("kind") == "ConfigMap" and "config.json" in (d.get("data") or {}):
            try:
                conf = json.loads(d["data"]["config.json"])
                e = [x.message for x in jsonschema.Draft202012Validator(rdma_schema).iter_errors(conf)]
                names = [c.get("resourceName") for c in conf.get("configList", [])]
                if len(names) != len(set(names)):
                    e.append(f"resourceName not unique: {names}")
            except ValueError as ex:
                e = [f"config.json is not JSON: {ex}"]
            report(not e, f"{what} config.json against the RDMA shared device plugin's config schema", "; ".join(e))
    for e in cross_checks(docs):
        report(False, "cross-check", e)
    if not cross_checks(docs):
        report(True, f"cross-checks over {len(docs)} objects (IPC_LOCK with RDMA, resources defined, networks defined, /fabric/env.sh written where sourced)")
    n = sum(1 for _ in docs)
    print(f"{n} objects in {len(files)} files; {'all valid' if not fails else f'{fails} failure(s)'}")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
