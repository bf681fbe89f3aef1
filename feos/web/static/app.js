// The feos console: the pods and their events, live; the forms check what they send and show
// the API's own errors by field. Every call goes to /api/SERVICE/METHOD with the CSRF token.
"use strict";

const CSRF = document.querySelector('meta[name="csrf-token"]').content;
const pods = new Map();      // id -> PodInfo (the API's dict)
const events = new Map();    // id -> the last events, newest first
const refresh = new Map();   // id -> a pending getPod's timer
const $ = (sel, root = document) => root.querySelector(sel);
const esc = (s) => String(s ?? "").replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);

class ApiError extends Error {
  constructor(code, message) { super(message); this.code = code; }
}

async function call(service, method, params = {}) {
  const r = await fetch(`/api/${service}/${method}`, {
    method: "POST", credentials: "same-origin",
    headers: {"content-type": "application/json", "x-csrf-token": CSRF},
    body: JSON.stringify(params),
  });
  if (!r.ok) throw new ApiError("http" + r.status, await r.text());
  const answer = await r.json();
  if (answer.status && answer.status.code && answer.status.code !== "ok") {
    throw new ApiError(answer.status.code, answer.status.message);
  }
  return answer;
}

// -- errors by field ---------------------------------------------------------------------------

function clearErrors(form) {
  form.querySelectorAll(".invalid").forEach((e) => e.classList.remove("invalid"));
  form.querySelectorAll(".error").forEach((e) => { e.textContent = ""; });
}

// "spec.containers[0].image: must be ..." -> the input whose data-field is the longest prefix.
function fieldOf(form, path) {
  const bare = path.replace(/\[\d+\]/g, "");
  let best = null;
  for (const input of form.querySelectorAll("[data-field]")) {
    const f = input.dataset.field;
    if ((bare === f || bare.startsWith(f + ".")) && (!best || f.length > best.dataset.field.length)) best = input;
  }
  return best;
}

function showError(form, message, input = null) {
  const m = /^([A-Za-z0-9_.\[\]]+): /.exec(message);
  input = input || (m && fieldOf(form, m[1]));
  let box = $('[data-error="form"]', form);
  if (input) {
    input.classList.add("invalid");
    box = input.parentElement.querySelector(".error") || input.insertAdjacentElement("afterend", Object.assign(document.createElement("p"), {className: "error"}));
  }
  box.textContent = (box.textContent ? box.textContent + "\n" : "") + message;
}

// -- the create form ---------------------------------------------------------------------------

const ID_RE = /^[a-hjkmnp-tv-z][0-9a-hjkmnp-tv-z]{10}$/;
const UUID_RE = /^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$/;
const PORT_RE = /^(?:(\[[0-9a-fA-F:.]+\]|[0-9.]+):)?(\d{1,5}):(\d{1,5})(?:\/(tcp|udp))?$/;
const VOLUME_RE = /^([0-9a-f-]{36}):(\/[^:]*)(?::(ro))?$/;

function newId() {
  const a = "abcdefghjkmnpqrstvwxyz", b = "0123456789" + a, r = crypto.getRandomValues(new Uint8Array(11));
  return a[r[0] % a.length] + Array.from(r.slice(1), (x) => b[x % b.length]).join("");
}

function lines(text) { return text.split("\n").map((s) => s.trim()).filter(Boolean); }

// The form as a CreatePod's params, or the list of [input, message] it breaks.
function podParams(form) {
  const f = form.elements, bad = [];
  const id = f.id.value.trim() || newId();
  if (!ID_RE.test(id) && !UUID_RE.test(id)) bad.push([f.id, "id: must be 11 of lowercase Crockford base32 with a letter first, or a lowercase UUID"]);
  if (!f.image.value.trim()) bad.push([f.image, "image: give an OCI reference"]);
  const vcpus = Number(f.vcpus.value), memory = Number(f.memory.value);
  if (!Number.isInteger(vcpus) || vcpus < 1 || vcpus > 32) bad.push([f.vcpus, "CPUs: a whole number from 1 to 32"]);
  if (!Number.isInteger(memory) || memory < 128 || memory % 2) bad.push([f.memory, "memory: an even number of MiB, at least 128"]);
  const publish = [], volumes = [], mounts = [];
  for (const line of lines(f.ports.value)) {
    const m = PORT_RE.exec(line);
    if (!m) { bad.push([f.ports, `published port ${line}: give [ADDRESS:]HOSTPORT:PODPORT[/tcp|/udp]`]); continue; }
    publish.push({hostAddress: (m[1] || "").replace(/[\[\]]/g, ""), hostPort: Number(m[2]), podPort: Number(m[3]), protocol: m[4] || "tcp"});
  }
  lines(f.volumes.value).forEach((line, i) => {
    const m = VOLUME_RE.exec(line);
    if (!m) { bad.push([f.volumes, `volume ${line}: give VOLUME-ID:/path[:ro]`]); return; }
    volumes.push({name: `v${i}`, volumeId: m[1]});
    mounts.push({volume: `v${i}`, path: m[2], readOnly: m[3] === "ro"});
  });
  if (publish.length && f.nonet.checked) bad.push([f.ports, "published ports need a network"]);
  const container = {name: "main", image: f.image.value.trim(), command: f.command.value.trim() ? f.command.value.trim().split(/\s+/) : [], volumeMounts: mounts};
  const network = f.nonet.checked ? {none: null} : {pod: {publish}};
  return {bad, params: {id, spec: {vcpus, memoryMib: memory, containers: [container], volumes, network}}};
}

async function submit(form, make, done) {
  clearErrors(form);
  const {bad, params} = make(form);
  if (bad.length) { bad.forEach(([input, msg]) => showError(form, msg, input)); return; }
  try { await done(params); }
  catch (e) { showError(form, e.message); }
}

// -- the pods ----------------------------------------------------------------------------------

function urls(pod) {
  const publish = ((pod.spec.network || {}).pod || {}).publish || [];
  return publish.map((p) => {
    const host = p.hostAddress || location.hostname;
    const where = host.includes(":") ? `[${host}]` : host;
    return (p.protocol || "tcp") === "tcp" ? `http://${where}:${p.hostPort}/` : `udp ${where}:${p.hostPort}`;
  });
}

// A card: its view (redrawn on every change) and its buttons (drawn once, so a click lands).
function podView(pod) {
  const c = (pod.containers || []);
  const containers = pod.spec.containers.map((s) => {
    const st = c.find((x) => x.name === s.name);
    return `<li>${esc(s.name)} <small>${esc(s.image)}</small> ${st ? `<span class="state">${esc(st.state)}</span>` : ""}
      <a href="#log/logs/${esc(pod.id)}/${esc(s.name)}">logs</a></li>`;
  }).join("");
  const links = urls(pod).map((u) => u.startsWith("http") ? `<a href="${esc(u)}">${esc(u)}</a>` : esc(u)).join("<br>");
  const evs = (events.get(pod.id) || []).map((e) =>
    `<li>${new Date(e.timeUnixNs / 1e6).toLocaleTimeString()} ${esc(e.state)}${e.step ? " · " + esc(e.step) : ""}${e.reason ? " · " + esc(e.reason) : ""}</li>`).join("");
  const ev = (events.get(pod.id) || [])[0];
  return `<h3>${esc(pod.id)}</h3>
    <span class="state ${esc(pod.state)}" data-state data-event-ns="${ev ? ev.timeUnixNs : ""}">${esc(pod.state)}${pod.step && pod.state === "pending" ? " · " + esc(pod.step) : ""}</span>
    <dl>${pod.reason ? `<dt>reason</dt><dd>${esc(pod.reason)}</dd>` : ""}
      <dt>addresses</dt><dd>${esc([pod.ipv6Address, pod.ipv4Address].filter(Boolean).join(", ") || "none")}</dd>
      <dt>size</dt><dd>${pod.spec.vcpus} CPU · ${pod.spec.memoryMib} MiB</dd>
      ${links ? `<dt>published</dt><dd>${links}</dd>` : ""}
      <dt>containers</dt><dd><ul class="events">${containers}</ul></dd></dl>
    <ul class="events" data-events>${evs}</ul>`;
}

function podCard(pod) {
  return `<div class="view">${podView(pod)}</div>
    <div class="actions">
      ${["start", "stop", "suspend", "resume"].map((a) => `<button class="quiet" data-act="${a}">${a}</button>`).join("")}
      <button class="danger" data-act="delete">delete</button>
      <a href="#log/console/${esc(pod.id)}">console log</a></div>
    <p class="error"></p>`;
}

function renderPod(pod) {
  let card = document.getElementById("pod-" + pod.id);
  if (!card) {
    card = document.createElement("article");
    card.id = "pod-" + pod.id; card.className = "card pod"; card.dataset.pod = pod.id;
    card.innerHTML = podCard(pod);
    $("#pods").prepend(card);
    return;
  }
  const view = document.createElement("div");
  view.className = "view"; view.innerHTML = podView(pod);
  card.querySelector(".view").replaceWith(view);
}

function renderPods() {
  const list = [...pods.values()].sort((a, b) => b.createdUnixNs - a.createdUnixNs);
  $("#pods").innerHTML = list.map((p) => `<article id="pod-${esc(p.id)}" class="card pod" data-pod="${esc(p.id)}">${podCard(p)}</article>`).join("");
  $("#pods").dataset.count = String(list.length);
  window.podsRenderedAt = performance.now();  // for bench/console.py: from navigation start
}

async function loadPod(id) {
  try { const {pod} = await call("pods", "getPod", {id}); pods.set(id, pod); renderPod(pod); }
  catch (e) { if (e.code !== "notFound") console.warn(e); }
}

function onEvent(e) {
  const list = events.get(e.podId) || [];
  list.unshift(e); list.length = Math.min(list.length, 8); events.set(e.podId, list);
  if (e.deleted) {
    pods.delete(e.podId); events.delete(e.podId);
    document.getElementById("pod-" + e.podId)?.remove();
    return;
  }
  // A pod not seen yet gets a card from its event at once; GetPod fills it in.
  const pod = pods.get(e.podId) || {id: e.podId, createdUnixNs: e.timeUnixNs,
    spec: {containers: [], vcpus: "?", memoryMib: "?", network: {}}};
  Object.assign(pod, {state: e.state, reason: e.reason, step: e.step});
  pods.set(e.podId, pod); renderPod(pod);
  clearTimeout(refresh.get(e.podId));
  refresh.set(e.podId, setTimeout(() => loadPod(e.podId), 100));
}

async function act(card, action) {
  const id = card.dataset.pod, box = card.querySelector("p.error");
  box.textContent = "";
  if (action === "delete" && !confirm(`Delete pod ${id}?`)) return;
  try {
    const method = action + "Pod";
    const answer = await call("pods", method, {id});
    if (answer.pod) { pods.set(id, answer.pod); renderPod(answer.pod); }
  } catch (err) { card.querySelector("p.error").textContent = err.message; }
}

function watch() {
  const live = $("#live");
  const source = new EventSource("/events");
  source.onopen = async () => {
    live.textContent = "live"; live.classList.add("on");
    const {pods: all} = await call("pods", "listPods");
    pods.clear(); all.forEach((p) => pods.set(p.id, p)); renderPods();
    document.body.dataset.ready = "1";
  };
  source.onmessage = (m) => onEvent(JSON.parse(m.data));
  source.onerror = () => { live.textContent = "offline"; live.classList.remove("on"); };
}

// -- volumes, security groups, name tables --------------------------------------------------

function jsonCard(title, value, del) {
  return `<article class="card"><h3>${esc(title)}</h3><pre class="json">${esc(JSON.stringify(value, null, 1))}</pre>
    <div class="actions"><button class="quiet" data-edit>edit</button><button class="danger" data-del="${esc(del)}">delete</button></div><p class="error"></p></article>`;
}

const TABLES = {
  volumes: {list: ["volumes", "listVolumes", "volumes"], del: ["volumes", "deleteVolume"],
    card: (v) => jsonCard(`${v.id} · ${v.state}`, v, v.id)},
  groups: {list: ["securityGroups", "listSecurityGroups", "groups"], del: ["securityGroups", "deleteSecurityGroup"],
    card: (g) => jsonCard(g.id, g, g.id), form: "#group-form", key: "group"},
  names: {list: ["names", "listNameTables", "tables"], del: ["names", "deleteNameTable"],
    card: (t) => jsonCard(`${t.id} · v${t.version}`, t, t.id), form: "#name-form", key: "table"},
};

async function loadTable(name) {
  const t = TABLES[name], el = $("#" + name);
  try {
    const answer = await call(t.list[0], t.list[1]);
    const items = answer[t.list[2]] || [];
    el.innerHTML = items.map(t.card).join("") || "<p>none</p>";
    el.querySelectorAll("[data-edit]").forEach((b, i) => b.onclick = () => {
      const form = $(t.form || "#volume-form");
      if (form.elements.json) { form.elements.json.value = JSON.stringify(items[i], null, 1); form.scrollIntoView(); }
    });
    el.querySelectorAll("[data-del]").forEach((b) => b.onclick = async () => {
      if (!confirm(`Delete ${b.dataset.del}?`)) return;
      try { await call(t.del[0], t.del[1], {id: b.dataset.del}); loadTable(name); }
      catch (e) { b.closest(".card").querySelector(".error").textContent = e.message; }
    });
  } catch (e) { el.textContent = e.message; }
}

function jsonParams(key) {
  return (form) => {
    try { return {bad: [], params: {[key]: JSON.parse(form.elements.json.value)}}; }
    catch (e) { return {bad: [[form.elements.json, `${key}: not JSON (${e.message})`]], params: null}; }
  };
}

// -- the mesh (read only: its peers come from the control plane) ------------------------------

async function loadMesh() {
  const el = $("#mesh");
  try {
    const {mesh} = await call("mesh", "getMesh");
    const node = `<article class="card" data-mesh="node"><h3>this node · ${esc(mesh.nodePrefix || "no prefix yet")}</h3>
      <dl><dt>ULA</dt><dd>${esc(mesh.ula || "-")}</dd><dt>public key</dt><dd><code>${esc(mesh.publicKey)}</code></dd>
      <dt>port</dt><dd>${esc(mesh.port)}</dd><dt>version</dt><dd>${esc(mesh.version)}</dd></dl></article>`;
    const peers = (mesh.peers || []).map((p) => `<article class="card" data-mesh="peer"><h3>${esc(p.prefix)}</h3>
      <dl><dt>endpoint</dt><dd>${esc(p.endpoint)}</dd><dt>public key</dt><dd><code>${esc(p.publicKey)}</code></dd></dl></article>`);
    el.innerHTML = node + (peers.join("") || "<p>no peers</p>");
  } catch (e) { el.textContent = e.message; }
}

// -- logs ---------------------------------------------------------------------------------------

let logSource = null;
function showLog(kind, id, container) {
  if (logSource) logSource.close();
  const pre = $("#log"); pre.textContent = "";
  $("#log-title").textContent = kind === "console" ? `${id}: serial console` : `${id}/${container}: logs`;
  const q = new URLSearchParams({id, follow: "1", ...(container ? {container} : {})});
  logSource = new EventSource(`/stream/${kind}?${q}`);
  logSource.onmessage = (m) => {
    const d = JSON.parse(m.data);
    pre.textContent += d.status ? `\n[${d.status.code}] ${d.status.message}\n` : (d.stdout || "") + (d.stderr || "");
  };
  logSource.addEventListener("end", () => { logSource.close(); logSource = null; });
}

// -- tabs and wiring ------------------------------------------------------------------------

function route() {
  const [tab, kind, id, container] = (location.hash.slice(1) || "pods").split("/");
  const name = ["pods", "volumes", "groups", "names", "mesh", "log"].includes(tab) ? tab : "pods";
  document.querySelectorAll(".tab").forEach((s) => { s.hidden = s.id !== "tab-" + name; });
  document.querySelectorAll("nav a").forEach((a) => a.classList.toggle("on", a.dataset.tab === name));
  if (name !== "log" && logSource) { logSource.close(); logSource = null; }
  if (name === "log") showLog(kind, id, container);
  else if (name === "mesh") loadMesh();
  else if (TABLES[name]) loadTable(name);
}

document.addEventListener("DOMContentLoaded", () => {
  $("#create-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    submit(ev.target, podParams, async (params) => {
      const {pod} = await call("pods", "createPod", params);
      pods.set(pod.id, pod); renderPod(pod); ev.target.reset();
    });
  });
  $("#volume-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    submit(ev.target, (form) => {
      const mib = Number(form.elements.size.value);
      return Number.isInteger(mib) && mib >= 64 ? {bad: [], params: {id: crypto.randomUUID(), sizeBytes: mib * 1048576}}
        : {bad: [[form.elements.size, "size: a whole number of MiB, at least 64"]], params: null};
    }, async (params) => { await call("volumes", "createVolume", params); loadTable("volumes"); });
  });
  for (const name of ["groups", "names"]) {
    const t = TABLES[name];
    $(t.form).addEventListener("submit", (ev) => {
      ev.preventDefault();
      submit(ev.target, jsonParams(t.key), async (params) => {
        await call(name === "groups" ? "securityGroups" : "names", name === "groups" ? "putSecurityGroup" : "putNameTable", params);
        loadTable(name);
      });
    });
  }
  $("#pods").addEventListener("click", (ev) => {
    const b = ev.target.closest("button[data-act]");
    if (b) act(b.closest(".pod"), b.dataset.act);
  });
  window.addEventListener("hashchange", route);
  route();
  watch();
});
