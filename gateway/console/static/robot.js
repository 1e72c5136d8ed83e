// The robot view: the selected env's live camera, its state, and joint-state and action plots.
// Frames come over one WebSocket (/ws/camera): a u32 header length, a JSON header, then the
// JPEG. Each drawn frame is acknowledged, so the server only ever sends the newest one.
"use strict";

const PLOT_POINTS = 300;
let cameraSocket = null;
let watching = null;
const cameraStats = { frames: 0, drawn: [], latencies: [], lastRenderMs: null, last: null };
window.consoleCamera = cameraStats;  // benchmarks and tests read what the page measured (and may set onframe)
const robotPlots = {};
const robotSeries = { t: [], joint_pos: [], action: [] };

function nowMs() { return performance.timeOrigin + performance.now(); }

function watchTarget() {
  const worker = $("teleop-worker").value;
  const env = Number.parseInt($("teleop-env").value, 10) || 0;
  return worker ? { worker, env } : null;
}

function watch() {
  const target = watchTarget();
  if (!target || !cameraSocket || cameraSocket.readyState !== WebSocket.OPEN) return;
  if (watching && watching.worker === target.worker && watching.env === target.env) return;
  watching = target;
  for (const key of Object.keys(robotSeries)) robotSeries[key] = [];
  cameraSocket.send(JSON.stringify({ type: "watch", ...target }));
}

function openCamera() {
  if (cameraSocket || !role) return;
  cameraSocket = new WebSocket(wsUrl("/ws/camera"));
  cameraSocket.binaryType = "arraybuffer";
  cameraSocket.onopen = () => { watching = null; watch(); };
  cameraSocket.onmessage = (event) => {
    if (typeof event.data === "string") {
      const msg = JSON.parse(event.data);
      if (msg.type === "error") showError(msg.message);
      return;
    }
    onFrame(event.data);
  };
  cameraSocket.onclose = () => { cameraSocket = null; watching = null; if (role) setTimeout(openCamera, 1000); };
}

async function onFrame(buffer) {
  const size = new DataView(buffer).getUint32(0);
  const header = JSON.parse(new TextDecoder().decode(new Uint8Array(buffer, 4, size)));
  if (header.image) {
    const blob = new Blob([new Uint8Array(buffer, 4 + size)], { type: "image/jpeg" });
    try {
      const bitmap = await createImageBitmap(blob);
      const canvas = $("camera");
      if (canvas.width !== bitmap.width || canvas.height !== bitmap.height) {
        canvas.width = bitmap.width;
        canvas.height = bitmap.height;
      }
      canvas.getContext("2d").drawImage(bitmap, 0, 0);
      bitmap.close();
    } catch (e) { showError(`camera frame: ${e.message}`); }
  }
  const drawn = nowMs();
  if (cameraSocket && cameraSocket.readyState === WebSocket.OPEN) {
    cameraSocket.send(JSON.stringify({ type: "ack", seq: header.seq }));
  }
  cameraStats.frames += 1;
  cameraStats.last = header;
  if (header.image && header.t_render_ms !== cameraStats.lastRenderMs) {
    cameraStats.latencies.push(drawn - header.t_render_ms);
    cameraStats.drawn.push(drawn);
    if (cameraStats.latencies.length > 5000) { cameraStats.latencies.shift(); cameraStats.drawn.shift(); }
  }
  cameraStats.lastRenderMs = header.t_render_ms;
  if (cameraStats.onframe) cameraStats.onframe(header, drawn);
  showRobotState(header, drawn);
}

function framesPerSecond(now) {
  const recent = cameraStats.drawn.filter((t) => now - t <= 2000);
  return recent.length / 2;
}

// The readouts and plots are redrawn 5 times a second, the newest frame's state each time:
// rewriting them on every frame made the page lay itself out 20+ times a second, which on
// a loaded machine costs the camera frames (and the e-stop's fetch) their CPU.
const SHOW_MS = 200;
let shownAt = 0;
let showTimer = null;
let unshown = null;

function showRobotState(h, drawn) {
  const s = robotSeries;
  s.t.push(h.t_render_ms / 1000);
  s.joint_pos.push(h.joint_pos || []);
  s.action.push(h.action || []);
  if (s.t.length > PLOT_POINTS) for (const key of Object.keys(s)) s[key].shift();
  unshown = [h, drawn];
  const wait = shownAt + SHOW_MS - nowMs();
  if (wait > 0) {
    if (showTimer === null) showTimer = setTimeout(showNewest, wait);  // the last frame is shown too
    return;
  }
  showNewest();
}

function showNewest() {
  showTimer = null;
  if (unshown === null) return;
  const [h, drawn] = unshown;
  unshown = null;
  shownAt = nowMs();
  const fps = framesPerSecond(drawn);
  const latency = drawn - h.t_render_ms;
  $("camera-info").textContent = h.image
    ? `${fps.toFixed(1)} frames/s, ${latency.toFixed(0)} ms from render to screen`
    : "this env renders no camera";
  $("r-step").textContent = `${h.episode} / ${h.step}`;
  $("r-reward").textContent = h.reward.toFixed(4);
  const flags = [h.success ? "success" : null, h.terminated ? "terminated" : null, h.truncated ? "truncated" : null];
  $("r-flags").textContent = flags.filter(Boolean).join(", ") || "none";
  $("r-version").textContent = text(h.policy_version);
  plotRobot();
}

function plotRobot() {
  const s = robotSeries;
  for (const name of ["joint_pos", "action"]) {
    const width = Math.max(0, ...s[name].map((v) => v.length));
    if (!width || s.t.length < 2) continue;
    const data = [s.t];
    for (let j = 0; j < width; j += 1) data.push(s[name].map((v) => (j < v.length ? v[j] : null)));
    const known = robotPlots[name];
    if (known && known.plot.series.length === width + 1) { known.plot.setData(data); continue; }
    if (known) { known.plot.destroy(); known.box.remove(); }
    const box = document.createElement("figure");
    box.dataset.series = name;
    $("robot-plots").append(box);
    const colors = ["#06c", "#c60", "#090", "#909", "#666", "#c00", "#0aa"];
    const series = [{}];
    for (let j = 0; j < width; j += 1) series.push({ label: `${name}[${j}]`, stroke: colors[j % colors.length], width: 1.5 });
    const title = name === "joint_pos" ? "Joint positions" : "Action";
    robotPlots[name] = { plot: new uPlot({ title, width: 340, height: 160, series }, data, box), box };
  }
}

$("logout").addEventListener("click", () => { if (cameraSocket) cameraSocket.close(); });
$("teleop-worker").addEventListener("change", watch);
$("teleop-env").addEventListener("change", watch);
setInterval(() => { if (role) { openCamera(); watch(); } }, 500);

// Demonstrations: takes of the selected env, stored in the replay service's demos table.
function showRecording(state) {
  const operator = role === "operator";
  $("rec-start").disabled = !operator || state.recording;
  $("rec-stop").disabled = !operator || !state.recording;
  $("rec-again").disabled = !operator || !state.recording;
  $("mark-success").disabled = !operator || !state.recording;
  $("mark-failure").disabled = !operator || !state.recording;
  let line = state.recording
    ? `recording take ${state.take} of ${state.worker} env ${state.env}${state.label ? ` (${state.label})` : ""}`
    : "not recording";
  if (!state.recording && state.last) {
    line += `; last take ${state.last.take}: ${state.last.steps} steps stored as ${state.last.episodes.length} demo episode(s)`;
    if (state.last.label) line += `, ${state.last.label}`;
  }
  $("rec-state").textContent = line;
}

async function recordAction(path, body) {
  const target = watchTarget() || {};
  try {
    const state = await post(path, { ...target, note: $("demo-note").value || null, ...body });
    showError("");
    showRecording(state);
    if (path === "/api/record" && body.action === "stop") $("demo-note").value = "";
  } catch (e) { showError(`${body.action || body.label}: ${e.message}`); }
}

$("rec-start").addEventListener("click", () => recordAction("/api/record", { action: "start" }));
$("rec-stop").addEventListener("click", () => {
  $("rec-state").textContent = "storing the take...";
  recordAction("/api/record", { action: "stop" });
});
$("rec-again").addEventListener("click", () => recordAction("/api/record", { action: "rerecord" }));
$("mark-success").addEventListener("click", () => recordAction("/api/label", { label: "success" }));
$("mark-failure").addEventListener("click", () => recordAction("/api/label", { label: "failure" }));
setInterval(async () => {
  if (!role || $("rec-state").textContent === "storing the take...") return;
  try {
    const response = await fetch("/api/record", { credentials: "same-origin" });
    if (response.ok) showRecording(await response.json());
  } catch (e) { /* the next poll tries again */ }
}, 1000);
