// The loopgate console's page: login, fleet view, e-stop, keyboard teleoperation.
// Plain JS, no dependencies; every request goes to the console's own origin.
"use strict";

const $ = (id) => document.getElementById(id);
const KEYS = { KeyQ: [0, 1], KeyA: [0, -1], KeyW: [1, 1], KeyS: [1, -1], KeyE: [2, 1], KeyD: [2, -1] };
const SEND_MS = 50;

let role = null;
let fleetSocket = null;
let teleopSocket = null;
let estopSocket = null;
let estopId = 0;
const estopWaiting = new Map();  // id -> [resolve, reject] of an e-stop sent on estopSocket
let inControl = false;
let actionSize = 3;
let seq = 0;
const held = new Set();

function showError(text) { $("error").textContent = text || ""; }

async function post(path, body) {
  const response = await fetch(path, {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify(body || {}),
    credentials: "same-origin",
  });
  let data = {};
  try { data = await response.json(); } catch (e) { data = { error: `HTTP ${response.status}` }; }
  if (!response.ok) throw new Error(data.error || `HTTP ${response.status}`);
  return data;
}

function wsUrl(path) { return `${location.protocol === "https:" ? "wss" : "ws"}://${location.host}${path}`; }

function showLogin() {
  role = null;
  $("login-view").hidden = false;
  $("main-view").hidden = true;
  $("stop-bar").hidden = true;
  $("logout").hidden = true;
  $("who").textContent = "";
  $("token").focus();
}

function showMain(newRole) {
  role = newRole;
  $("login-view").hidden = true;
  $("main-view").hidden = false;
  $("stop-bar").hidden = false;
  $("logout").hidden = false;
  $("who").textContent = `logged in as ${role}`;
  $("resume").disabled = role !== "operator";
  $("takeover").disabled = false;
  openFleet();
  openEstop();
  openTeleop();
  refreshMetrics();
}

function openFleet() {
  if (fleetSocket) return;
  fleetSocket = new WebSocket(wsUrl("/ws/fleet"));
  fleetSocket.onmessage = (event) => renderFleet(JSON.parse(event.data));
  fleetSocket.onclose = () => { fleetSocket = null; if (role) setTimeout(openFleet, 1000); };
}

// The e-stop's own WebSocket, open from login on, so pressing E-stop sends one message on
// a connection that is already there; a POST is the way when it is not (estop()).
function openEstop() {
  if (estopSocket) return;
  estopSocket = new WebSocket(wsUrl("/ws/estop"));
  estopSocket.onmessage = (event) => {
    const msg = JSON.parse(event.data);
    const waiting = estopWaiting.get(msg.id);
    if (!waiting) return;
    estopWaiting.delete(msg.id);
    if (msg.type === "estop") waiting[0](msg); else waiting[1](new Error(msg.message));
  };
  estopSocket.onclose = () => {
    estopSocket = null;
    for (const [, waiting] of estopWaiting) waiting[1](new Error("the e-stop connection closed"));
    estopWaiting.clear();
    if (role) setTimeout(openEstop, 1000);
  };
}

// Engage the e-stop: on its WebSocket when open, else (or when that gets no answer within
// two seconds) by POST. Resolves with the console's answer (t_engaged_ms: when the gateway
// engaged it).
async function estop() {
  if (estopSocket && estopSocket.readyState === WebSocket.OPEN) {
    const id = ++estopId;
    const answered = new Promise((resolve, reject) => estopWaiting.set(id, [resolve, reject]));
    estopSocket.send(JSON.stringify({ type: "estop", id }));
    const late = new Promise((_, reject) => setTimeout(() => reject(new Error("no answer")), 2000));
    try { return await Promise.race([answered, late]); } catch (e) { estopWaiting.delete(id); }
  }
  return post("/api/estop");
}
window.consoleEstop = estop;

function text(value) { return value === null || value === undefined ? "-" : String(value); }

function renderFleet(f) {
  $("f-backend").textContent = `${text(f.backend)} (${text(f.task)})`;
  $("f-env-steps").textContent = text(f.env_steps);
  $("f-rate").textContent = text(f.steps_per_s);
  $("f-episodes").textContent = text(f.episodes);
  $("f-policy").textContent = text(f.policy_kind);
  $("f-version").textContent = text(f.policy_version);
  $("f-lag").textContent = `${text(f.policy_lag_mean)} / ${text(f.policy_lag_max)}`;
  const state = f.error ? f.error : f.estopped ? "E-STOPPED" : f.held ? `held (${f.held})` : "running";
  $("f-state").textContent = state;
  const estop = $("estop-state");
  estop.textContent = f.estopped ? "E-stop engaged" : "E-stop released";
  estop.className = f.estopped ? "estopped" : "";
  const body = document.querySelector("#workers tbody");
  body.replaceChildren(...f.workers.map((w) => {
    const row = document.createElement("tr");
    for (const value of [w.uid, w.num_envs, w.env_steps, w.rtt_us, w.control]) {
      const cell = document.createElement("td");
      cell.textContent = text(value);
      row.append(cell);
    }
    return row;
  }));
  const select = $("teleop-worker");
  const known = Array.from(select.options).map((o) => o.value).join(",");
  if (known !== f.workers.map((w) => w.uid).join(",")) {
    select.replaceChildren(...f.workers.map((w) => new Option(w.uid, w.uid)));
  }
}

const charts = {};
const METRICS_MS = 2000;
const CHART_TITLES = {
  hop_p50: "Per-hop latency p50 (µs)",
  hop_p99: "Per-hop latency p99 (µs)",
  replay_fill: "Replay fill (size / max size)",
  samples_per_insert: "Samples per insert",
  intervention_rate: "Intervention rate",
};
const COLORS = ["#06c", "#c60", "#090", "#909", "#666", "#c00", "#0aa", "#a60"];

// Series named "group/member" share one chart (one line per member), aligned on time.
function chartGroups(series) {
  const groups = {};
  for (const [name, points] of Object.entries(series)) {
    const [group, member] = name.includes("/") ? name.split("/", 2) : [name, name];
    (groups[group] = groups[group] || {})[member] = points;
  }
  return groups;
}

function alignedData(members) {
  const xs = Array.from(new Set(Object.values(members).flatMap((p) => p.x))).sort((a, b) => a - b);
  const data = [xs];
  for (const points of Object.values(members)) {
    const at = new Map(points.x.map((x, i) => [x, points.y[i]]));
    data.push(xs.map((x) => (at.has(x) ? at.get(x) : null)));
  }
  return data;
}

function drawChart(group, members) {
  const data = alignedData(members);
  if (data[0].length < 2) return;
  const names = Object.keys(members);
  const known = charts[group];
  if (known && known.names === names.join(",")) { known.plot.setData(data); return; }
  if (known) { known.plot.destroy(); known.box.remove(); }
  const box = document.createElement("figure");
  box.dataset.series = group;
  $("charts").append(box);
  const series = [{}, ...names.map((n, i) => ({ label: n, stroke: COLORS[i % COLORS.length], width: 1.5, spanGaps: true }))];
  const axes = [{}, { size: 70 }];
  const plot = new uPlot({ title: CHART_TITLES[group] || group, width: 420, height: 170, series, axes }, data, box);
  charts[group] = { plot, box, names: names.join(",") };
}

function drawHistogram(name, counts) {
  const table = $("lag-histogram");
  const entries = Object.entries(counts).map(([k, v]) => [Number(k), v]).sort((a, b) => a[0] - b[0]);
  const total = entries.reduce((sum, [, v]) => sum + v, 0);
  table.hidden = entries.length === 0;
  table.querySelector("tbody").replaceChildren(...entries.map(([lag, count]) => {
    const row = document.createElement("tr");
    const bar = document.createElement("span");
    bar.className = "bar";
    bar.style.width = `${Math.max(1, Math.round((200 * count) / Math.max(1, total)))}px`;
    for (const value of [lag, count]) {
      const cell = document.createElement("td");
      cell.textContent = String(value);
      row.append(cell);
    }
    const cell = document.createElement("td");
    cell.append(bar, ` ${((100 * count) / Math.max(1, total)).toFixed(1)} %`);
    row.append(cell);
    return row;
  }));
}

async function refreshMetrics() {
  if (!role) return;
  let data;
  try {
    const response = await fetch("/api/metrics", { credentials: "same-origin" });
    if (!response.ok) return;
    data = await response.json();
  } catch (e) { return; }
  for (const [group, members] of Object.entries(chartGroups(data.series))) drawChart(group, members);
  if (data.histograms && data.histograms.policy_lag) drawHistogram("policy_lag", data.histograms.policy_lag);
}
setInterval(refreshMetrics, METRICS_MS);

function openTeleop() {
  if (teleopSocket) return;
  teleopSocket = new WebSocket(wsUrl("/ws/teleop"));
  teleopSocket.onopen = () => {
    for (const text of pendingTeleop.splice(0)) teleopSocket.send(text);
  };
  teleopSocket.onmessage = (event) => onTeleop(JSON.parse(event.data));
  teleopSocket.onclose = () => {
    teleopSocket = null;
    setControl(false);
    if (role) setTimeout(openTeleop, 1000);
  };
}

// Take-over and release wait for the socket to open (a click right after login must not be
// lost); commands and holds do not, since a stale one is worth nothing.
const pendingTeleop = [];

function sendTeleop(msg) {
  const text = JSON.stringify(msg);
  if (teleopSocket && teleopSocket.readyState === WebSocket.OPEN) teleopSocket.send(text);
  else if (msg.type === "take_over" || msg.type === "release") {
    pendingTeleop.push(text);
    openTeleop();
  }
}

function setControl(mine) {
  inControl = mine;
  $("takeover").disabled = mine;
  $("release").disabled = !mine;
  $("t-control").textContent = mine ? "you (console)" : "policy";
}

function onTeleop(msg) {
  if (msg.type === "error") { showError(msg.message); return; }
  if (msg.type === "taken") { actionSize = msg.action_size; showError(""); setControl(true); return; }
  if (msg.type === "released") { setControl(false); return; }
  if (msg.type !== "teleop") return;
  if (inControl && !msg.active) {
    setControl(false);
    if (msg.ended) showError(`control ended: ${msg.ended}`);
  }
  if (!msg.mine) return;
  $("t-holding").textContent = msg.holding ? `holding: ${msg.holding}` : "live";
  $("t-steps").textContent = text(msg.steps);
  $("t-action").textContent = (msg.action || []).map((a) => a.toFixed(3)).join(", ");
  $("t-joints").textContent = (msg.joint_pos || []).map((a) => a.toFixed(3)).join(", ");
}

function axes() {
  const out = new Array(actionSize).fill(0);
  for (const code of held) {
    const [index, sign] = KEYS[code];
    if (index < actionSize) out[index] = Math.max(-1, Math.min(1, out[index] + sign));
  }
  return out;
}

function hold(why) {
  held.clear();
  if (inControl) sendTeleop({ type: "hold", why });
}

// Gamepad (the browser Gamepad API): while button 0 (A) is held, axes 0.. drive joints 1..;
// letting go of it is the deadman, like releasing the keys.
const GAMEPAD_DEADZONE = 0.15;
let padDriving = false;
let windowBlurred = false;

function gamepadAxes() {
  const pads = navigator.getGamepads ? Array.from(navigator.getGamepads()).filter(Boolean) : [];
  const pad = pads[0];
  if (windowBlurred || document.hidden) return null;  // the deadman: leaving the page lets go
  if (!pad || !pad.buttons.length || !pad.buttons[0].pressed) return null;
  const out = new Array(actionSize).fill(0);
  for (let i = 0; i < Math.min(actionSize, pad.axes.length); i += 1) {
    const v = pad.axes[i];
    out[i] = Math.abs(v) < GAMEPAD_DEADZONE ? 0 : Math.max(-1, Math.min(1, v));
  }
  return out;
}

setInterval(() => {
  if (!inControl) { padDriving = false; return; }
  const pad = held.size === 0 ? gamepadAxes() : null;
  if (held.size === 0 && !pad) {
    if (padDriving) { padDriving = false; hold("gamepad button released"); }
    return;
  }
  padDriving = pad !== null;
  seq += 1;
  const env = Number.parseInt($("teleop-env").value, 10) || 0;
  sendTeleop({ type: "command", seq, t: performance.timeOrigin + performance.now(), env, axes: pad || axes() });
}, SEND_MS);

document.addEventListener("keydown", (event) => {
  if (!role) return;
  if (event.key === "Escape") { event.preventDefault(); $("estop").click(); return; }
  const target = event.target;
  if (target instanceof HTMLInputElement || target instanceof HTMLSelectElement) return;
  if (KEYS[event.code] && inControl) { held.add(event.code); event.preventDefault(); }
});
document.addEventListener("keyup", (event) => {
  if (!held.delete(event.code)) return;
  if (held.size === 0) hold("keys released");
});
window.addEventListener("blur", () => { windowBlurred = true; padDriving = false; hold("window blurred"); });
window.addEventListener("focus", () => { windowBlurred = false; });
document.addEventListener("visibilitychange", () => { if (document.hidden) { padDriving = false; hold("tab hidden"); } });

$("login-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  try {
    const data = await post("/api/login", { token: $("token").value });
    $("token").value = "";
    showError("");
    showMain(data.role);
  } catch (e) { showError(`login failed: ${e.message}`); }
});
$("logout").addEventListener("click", async () => {
  try { await post("/api/logout"); } finally {
    role = null;
    for (const socket of [fleetSocket, teleopSocket, estopSocket]) if (socket) socket.close();
    showLogin();
  }
});
$("estop").addEventListener("click", async () => {
  try { await estop(); hold("e-stop"); showError(""); } catch (e) { showError(`e-stop: ${e.message}`); }
});
$("resume").addEventListener("click", async () => {
  try { await post("/api/resume"); showError(""); } catch (e) { showError(`resume: ${e.message}`); }
});
$("takeover").addEventListener("click", () => {
  showError("");
  sendTeleop({ type: "take_over", worker: $("teleop-worker").value || null });
});
$("release").addEventListener("click", () => { hold("released"); sendTeleop({ type: "release" }); });

fetch("/api/me", { credentials: "same-origin" })
  .then((r) => (r.ok ? r.json().then((d) => showMain(d.role)) : showLogin()))
  .catch(() => showLogin());
