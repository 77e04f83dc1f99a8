// agent-r1 report page: SVG training curves and the trajectory viewer. No dependencies, no network.
// The data comes from <script id="report-data" type="application/json"> (see agent_r1/report/html.py).
"use strict";
(function () {
  const DATA = JSON.parse(document.getElementById("report-data").textContent);
  const SVG_NS = "http://www.w3.org/2000/svg";
  const PALETTE = ["#2f6fdb", "#e07b39", "#1f8a4c", "#c2332f", "#7b4bc4", "#0f9aa8", "#b7791f", "#d6489a", "#5a6b7d", "#88a832"];

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (value === null || value === undefined || value === false) continue;
      if (key === "class") node.className = value;
      else if (key === "text") node.textContent = value;
      else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
      else node.setAttribute(key, value);
    }
    for (const child of children.flat()) {
      if (child === null || child === undefined || child === false) continue;
      node.append(child instanceof Node ? child : String(child));
    }
    return node;
  }

  function svg(tag, attrs) {
    const node = document.createElementNS(SVG_NS, tag);
    for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, value);
    return node;
  }

  function fmt(v) {
    if (v === null || v === undefined) return "–";
    const a = Math.abs(v);
    if (Number.isInteger(v) && a < 1e9) return String(v);
    if (a !== 0 && (a >= 1e5 || a < 1e-3)) return v.toExponential(2);
    return String(+v.toPrecision(4));
  }

  function plural(n, word) {
    return `${n} ${word}${n === 1 ? "" : "s"}`;
  }

  // ---------------------------------------------------------------- charts
  function niceStep(lo, hi, count) {
    const span = hi - lo;
    const mag = Math.pow(10, Math.floor(Math.log10(span / count)));
    return [1, 2, 2.5, 5, 10].map((m) => m * mag).find((s) => span / s <= count) || 10 * mag;
  }

  function niceTicks(lo, hi, count) {
    const step = niceStep(lo, hi, count);
    const ticks = [];
    for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) ticks.push(+t.toPrecision(12));
    return ticks;
  }

  function extent(values) {
    let lo = Math.min(...values), hi = Math.max(...values);
    if (lo === hi) { const pad = lo === 0 ? 1 : Math.abs(lo) * 0.1; lo -= pad; hi += pad; }
    return [lo, hi];
  }

  // The y-axis runs from a labelled tick to a labelled tick, so its range is read off the axis.
  function yAxis(values) {
    const [lo, hi] = extent(values);
    const step = niceStep(lo, hi, 4);
    const bottom = +(Math.floor(lo / step + 1e-9) * step).toPrecision(12);
    const top = +(Math.ceil(hi / step - 1e-9) * step).toPrecision(12);
    const ticks = [];
    for (let t = bottom; t <= top + step * 1e-9; t += step) ticks.push(+t.toPrecision(12));
    return [bottom, top, ticks];
  }

  // Training steps are whole numbers: ticks on whole steps only.
  function stepTicks(lo, hi) {
    return niceTicks(lo, hi, 5).filter((t) => Number.isInteger(t));
  }

  function drawChart(spec) {
    const W = 440, H = 210, L = 54, R = 12, T = 8, B = 26;
    const series = spec.series.filter((s) => s.points.length > 0);
    const xs = series.flatMap((s) => s.points.map((p) => p[0]));
    const ys = series.flatMap((s) => s.points.map((p) => p[1]));
    let [x0, x1] = extent(xs);
    if (Math.min(...xs) === Math.max(...xs)) { x0 = xs[0] - 1; x1 = xs[0] + 1; }
    const [y0, y1, yTicks] = yAxis(ys);
    const sx = (x) => L + ((x - x0) / (x1 - x0)) * (W - L - R);
    const sy = (y) => H - B - ((y - y0) / (y1 - y0)) * (H - T - B);
    const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": spec.title });
    const grid = svg("g", { class: "grid" }), axis = svg("g", { class: "axis" });
    for (const t of yTicks) {
      grid.append(svg("line", { x1: L, x2: W - R, y1: sy(t), y2: sy(t) }));
      const label = svg("text", { x: L - 5, y: sy(t) + 3, "text-anchor": "end", class: "y-tick" });
      label.textContent = fmt(t);
      axis.append(label);
    }
    for (const t of stepTicks(x0, x1)) {
      const label = svg("text", { x: sx(t), y: H - B + 14, "text-anchor": "middle", class: "x-tick" });
      label.textContent = fmt(t);
      axis.append(label);
    }
    const xlabel = svg("text", { x: W - R, y: H - 2, "text-anchor": "end" });
    xlabel.textContent = "step";
    axis.append(xlabel);
    root.append(grid, axis, svg("line", { x1: L, x2: W - R, y1: H - B, y2: H - B, stroke: "#c9ced8" }));
    series.forEach((s, i) => {
      const color = PALETTE[i % PALETTE.length];
      const d = s.points.map((p, j) => `${j ? "L" : "M"}${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`).join("");
      root.append(svg("path", { class: "series", d: d, stroke: color, "data-key": s.key }));
      if (s.points.length <= 30) for (const p of s.points) root.append(svg("circle", { cx: sx(p[0]), cy: sy(p[1]), r: 2.2, fill: color }));
    });
    const hoverLine = svg("line", { class: "hover-line", y1: T, y2: H - B, visibility: "hidden" });
    const overlay = svg("rect", { x: L, y: T, width: W - L - R, height: H - T - B, fill: "transparent" });
    root.append(hoverLine, overlay);

    const tooltip = el("div", { class: "tooltip" });
    const prefix = spec.prefix + "/";
    const short = (key) => (key.startsWith(prefix) && series.length > 1 ? key.slice(prefix.length) : key);
    overlay.addEventListener("mousemove", (event) => {
      const box = root.getBoundingClientRect();
      const x = x0 + ((((event.clientX - box.left) / box.width) * W - L) / (W - L - R)) * (x1 - x0);
      let best = null;
      for (const v of xs) if (best === null || Math.abs(v - x) < Math.abs(best - x)) best = v;
      hoverLine.setAttribute("x1", sx(best));
      hoverLine.setAttribute("x2", sx(best));
      hoverLine.setAttribute("visibility", "visible");
      const lines = [`step ${fmt(best)}`];
      for (const s of series) {
        const hit = s.points.find((p) => p[0] === best);
        if (hit) lines.push(`${short(s.key)}: ${fmt(hit[1])}`);
      }
      tooltip.textContent = "";
      lines.forEach((line, i) => tooltip.append(i ? el("br") : "", line));
      tooltip.style.display = "block";
      tooltip.style.left = `${Math.min(event.clientX - box.left + 14, box.width - 120)}px`;
      tooltip.style.top = `${event.clientY - box.top + 24}px`;
    });
    overlay.addEventListener("mouseleave", () => {
      hoverLine.setAttribute("visibility", "hidden");
      tooltip.style.display = "none";
    });
    const legend = el("div", { class: "legend" },
      series.map((s, i) => el("span", { style: `--c:${PALETTE[i % PALETTE.length]}`, text: short(s.key) })));
    const notes = spec.notes.length ? el("ul", { class: "chart-notes" }, spec.notes.map((n) => el("li", { text: n }))) : null;
    return el("div", { class: "chart", "data-prefix": spec.prefix, "data-unit": spec.unit }, el("h3", { text: spec.title }), root, legend, notes, tooltip);
  }

  function renderCharts() {
    const box = document.getElementById("charts");
    if (!DATA.charts.length) { box.append(el("p", { class: "empty", text: "No metrics yet (metrics.jsonl is missing or empty)." })); return; }
    const constant = DATA.charts.filter((spec) => !spec.series.length).flatMap((spec) => spec.notes);
    if (constant.length) {
      box.before(el("p", { class: "constant-notes", id: "constant-notes" },
        el("b", { text: "Not drawn, constant over the run: " }), constant.join(" · ")));
    }
    for (const spec of DATA.charts) if (spec.series.length) box.append(drawChart(spec));
  }

  // ---------------------------------------------------------------- phase timeline
  function renderTimeline() {
    const box = document.getElementById("timeline");
    if (!box || !DATA.timeline.length) return;
    const rows = DATA.timeline, lanes = ["rollout", "update"];
    const W = 960, L = 64, R = 12, T = 6, lane = 26, B = 24, H = T + lanes.length * lane + B;
    const end = Math.max(...rows.flatMap((r) => lanes.filter((p) => r[p]).map((p) => r[p][1])));
    const sx = (t) => L + (t / (end || 1)) * (W - L - R);
    const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": "rollout and update timeline" });
    lanes.forEach((phase, i) => {
      const label = svg("text", { x: L - 6, y: T + i * lane + lane / 2 + 4, "text-anchor": "end", class: "lane" });
      label.textContent = phase;
      root.append(label);
      for (const r of rows) {
        if (!r[phase]) continue;
        const [a, b] = r[phase];
        const bar = svg("rect", { x: sx(a), y: T + i * lane + 3, width: Math.max(sx(b) - sx(a), 0.8), height: lane - 6,
          fill: PALETTE[r.step % 2 ? 0 : 1], opacity: phase === "rollout" ? 0.75 : 1 });
        const title = svg("title", {});
        title.textContent = `step ${r.step} ${phase}: ${fmt(a)}–${fmt(b)} s`;
        bar.append(title);
        root.append(bar);
        // Each bar is labelled with its training step where the label fits inside it.
        const text = String(r.step);
        if (sx(b) - sx(a) >= 7 * text.length + 4) {
          const label = svg("text", { x: (sx(a) + sx(b)) / 2, y: T + i * lane + lane / 2 + 4, "text-anchor": "middle", class: "bar-step" });
          label.textContent = text;
          root.append(label);
        }
      }
    });
    // Ticks no closer than ~70 px, so their labels never touch; the unit sits left of the axis.
    for (const t of niceTicks(0, end || 1, Math.max(2, Math.floor((W - L - R) / 70)))) {
      const label = svg("text", { x: sx(t), y: H - 6, "text-anchor": "middle", class: "lane tick" });
      label.textContent = fmt(t);
      root.append(label);
    }
    const unit = svg("text", { x: L - 16, y: H - 6, "text-anchor": "end", class: "lane" });
    unit.textContent = "time (s)";
    root.append(unit);
    box.append(root);
  }

  // ---------------------------------------------------------------- per-step time breakdown
  // Two stacked bars per step: the engine's seconds (prefill, decode, idle) and the learner's step.
  const PART_LABELS = {
    engine_prefill: "engine prefill", engine_decode: "engine decode", engine_idle: "engine idle",
    rollout_wait: "waiting for the rollout", learner_forward: "forward", learner_backward: "backward",
    optimizer: "optimizer", other_learning: "other learning phases", sync: "weight sync",
  };
  const PART_COLORS = {
    engine_prefill: "#0f9aa8", engine_decode: "#2f6fdb", engine_idle: "#c9ced8",
    rollout_wait: "#e9dcc3", learner_forward: "#e07b39", learner_backward: "#c2332f",
    optimizer: "#7b4bc4", other_learning: "#b7791f", sync: "#1f8a4c",
  };

  function renderBreakdown() {
    const box = document.getElementById("breakdown");
    if (!box || !DATA.breakdown || !DATA.breakdown.length) return;
    const rows = DATA.breakdown;
    const W = 960, H = 240, L = 54, R = 12, T = 8, B = 26;
    const total = (parts) => parts.reduce((a, p) => a + p[1], 0);
    const [, top, ticks] = yAxis([0, ...rows.flatMap((r) => [total(r.engine), total(r.learner)])]);
    const slot = (W - L - R) / rows.length, bar = Math.min(slot * 0.4, 28);
    const sy = (y) => H - B - (y / (top || 1)) * (H - T - B);
    const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": "seconds per step by component" });
    for (const t of ticks) {
      root.append(svg("line", { x1: L, x2: W - R, y1: sy(t), y2: sy(t), stroke: "#eef0f4" }));
      const label = svg("text", { x: L - 5, y: sy(t) + 3, "text-anchor": "end", class: "lane y-tick" });
      label.textContent = fmt(t);
      root.append(label);
    }
    const every = Math.max(1, Math.ceil(rows.length / Math.floor((W - L - R) / 40)));
    rows.forEach((r, i) => {
      const mid = L + slot * (i + 0.5);
      [["engine", mid - bar - 1], ["learner", mid + 1]].forEach(([side, x]) => {
        let y = 0;
        for (const [part, seconds] of r[side]) {
          if (seconds <= 0) continue;
          const rect = svg("rect", { x: x, y: sy(y + seconds), width: bar, height: Math.max(sy(y) - sy(y + seconds), 0.5),
            fill: PART_COLORS[part] || "#5a6b7d", class: "seg", "data-part": part, "data-step": r.step });
          const title = svg("title", {});
          title.textContent = `step ${r.step} ${PART_LABELS[part] || part}: ${fmt(seconds)} s`;
          rect.append(title);
          root.append(rect);
          y += seconds;
        }
      });
      if (i % every === 0) {
        const label = svg("text", { x: mid, y: H - B + 14, "text-anchor": "middle", class: "lane x-tick" });
        label.textContent = String(r.step);
        root.append(label);
      }
    });
    const xlabel = svg("text", { x: W - R, y: H - 2, "text-anchor": "end", class: "lane" });
    xlabel.textContent = "step";
    root.append(xlabel, svg("line", { x1: L, x2: W - R, y1: H - B, y2: H - B, stroke: "#c9ced8" }));
    const parts = [...new Set(rows.flatMap((r) => [...r.engine, ...r.learner].filter((p) => p[1] > 0).map((p) => p[0])))];
    const legend = el("div", { class: "legend" },
      parts.map((part) => el("span", { style: `--c:${PART_COLORS[part] || "#5a6b7d"}`, text: PART_LABELS[part] || part })));
    box.append(root, legend);
  }

  // ---------------------------------------------------------------- trajectory viewer
  const TRAJ = DATA.trajectories;
  const BY_ID = new Map(TRAJ.map((t) => [t.id, t]));
  const state = { outcome: "all", step: "all", search: "", selected: null, compare: false, threshold: 0.1 };

  // Rebuild each step's full prompt text: "ctx" segments point into the previous step's prompt + response.
  function promptTexts(t) {
    if (t._texts) return t._texts;
    let previous = "";
    t._texts = t.steps.map((step) => {
      if (!step.prompt) { previous = null; return null; }
      const text = step.prompt.map(([kind, payload]) =>
        kind === "ctx" ? (previous || "").slice(0, payload) : kind === "drop" ? "" : payload).join("");
      if (step.context !== "summary") previous = text + step.response;  // a summary request is a side call
      return text;
    });
    return t._texts;
  }

  function outcomeBadges(t) {
    return (t.tags.length ? t.tags : ["unknown"]).map((tag) => el("span", { class: `badge ${tag}`, text: tag }));
  }

  function signed(v) {
    return el("span", { class: v > 0 ? "pos" : v < 0 ? "neg" : "", text: fmt(v) });
  }

  function matches(t) {
    if (state.outcome !== "all" && !t.tags.includes(state.outcome)) return false;
    if (state.step !== "all" && String(t.train_step) !== state.step) return false;
    if (state.search && !`${t.id} ${t.task_id} ${t.group_id} ${t.role || ""} ${t.reason}`.toLowerCase().includes(state.search.toLowerCase())) return false;
    return true;
  }

  // Tokens sampled with probability below the threshold get a red background, darker the less likely.
  function paintToken(span) {
    const lp = parseFloat(span.dataset.lp), logThreshold = Math.log(state.threshold);
    const low = lp < logThreshold;
    span.classList.toggle("low", low);
    span.style.background = low ? `rgba(230, 57, 53, ${(0.18 + 0.55 * Math.min(1, (logThreshold - lp) / 4)).toFixed(2)})` : "";
  }

  function renderTokens(step) {
    if (!step.tokens) {
      return el("div", {},
        el("pre", { class: "box response", text: step.response }),
        el("div", { class: "empty", text: `per-token text not dumped; lowest token log-prob ${fmt(step.min_logprob)}` }));
    }
    const pre = el("pre", { class: "box response" });
    for (const [text, lp] of step.tokens) {
      const span = el("span", { class: "tok", text: text });
      if (lp !== null) {
        span.dataset.lp = lp;
        span.title = `p=${Math.exp(lp).toPrecision(3)} (log-prob ${lp.toFixed(3)})`;
        paintToken(span);
      }
      pre.append(span);
    }
    return pre;
  }

  function renderPrompt(t, step, i) {
    const label = el("div", { class: "label", text: `Prompt · ${step.prompt_tokens} tokens` });
    if (!step.prompt) return el("div", {}, label, el("div", { class: "empty", text: "prompt text not dumped" }));
    const texts = promptTexts(t);
    if (step.context === "initial") {
      return el("div", {}, label, el("details", { open: i === 0 && t.steps.length === 1 },
        el("summary", { text: `initial prompt (${texts[i].length} chars)` }), el("pre", { class: "box", text: texts[i] })));
    }
    if (step.context === "summary") {
      const turns = step.summary && step.summary.turns;
      return el("div", {}, label,
        el("div", { class: "rewritten", text: `summary step, trained: the policy summarises ${turns ? plural(turns, "earlier turn") : "the earlier turns"}; the next step's prompt holds exactly these response tokens` }),
        el("details", {}, el("summary", { text: `summarisation request (${texts[i].length} chars)` }), el("pre", { class: "box", text: texts[i] })));
    }
    if (step.context === "extends") {
      const [ctx, added] = [step.prompt[0][1], step.prompt[1][1]];
      return el("div", {}, label,
        el("details", {}, el("summary", { text: `earlier context, unchanged (${ctx} chars)` }),
          el("pre", { class: "box", text: texts[i].slice(0, ctx) })),
        el("div", { class: "label", text: "new since the previous step" }),
        el("pre", { class: "box prompt-new" }, el("span", { class: "seg-new", text: added })));
    }
    const dropped = step.prompt.filter(([k]) => k === "drop").reduce((n, [, s]) => n + s.length, 0);
    const note = step.context_note || {};
    const by = note.policy ? ` by policy "${note.policy}"` : "";
    const facts = [dropped ? `context rewritten${by}` : `context re-rendered${by}: not a token-level extension of the previous prompt + response, though none of its text is missing`];
    if (note.dropped_turns) facts.push(`the policy reports ${plural(note.dropped_turns, "turn")} dropped`);
    if (note.summarised) facts.push("history summarised");
    if (dropped) facts.push(`${dropped} chars of the previous prompt + response no longer shown to the model`);
    const body = el("pre", { class: "box prompt-diff" },
      step.prompt.map(([kind, text]) => el("span", { class: kind === "same" ? "seg-same" : `seg-${kind}`, text: text })));
    return el("div", {}, label, el("div", { class: "rewritten", text: facts.join(" · ") }), body);
  }

  function renderTools(step) {
    const parts = [];
    step.tool_calls.forEach((call, j) => {
      parts.push(el("div", { class: "tool-call" }, el("span", { class: "name", text: call.name }),
        `(${JSON.stringify(call.arguments === undefined ? {} : call.arguments)})`));
      if (j < step.tool_results.length) parts.push(el("pre", { class: "box tool-out", text: String(step.tool_results[j]) }));
    });
    step.tool_results.slice(step.tool_calls.length).forEach((r) => parts.push(el("pre", { class: "box tool-out", text: String(r) })));
    step.tool_errors.forEach((e) => parts.push(el("pre", { class: "box tool-err", text: String(e) })));
    // In "strict" mode the near miss was taken as the final answer and never shown to the model.
    if (step.near_miss && !step.tool_errors.includes(step.near_miss)) {
      parts.push(el("div", { class: "label", text: "near miss, taken as the final answer (near_miss: strict)" }),
        el("pre", { class: "box tool-err near-miss", text: step.near_miss }));
    }
    return parts.length ? el("div", { class: "tools" }, el("div", { class: "label", text: "Tool calls and outputs" }), parts) : null;
  }

  function toolCounts(step) {
    const c = step.tool_counts;
    if (!c) return null;
    const text = [plural(c.calls, "tool call"), plural(c.parse_errors, "parse error"), plural(c.tool_errors, "tool error")];
    return el("span", { class: "tool-counts" }, text.join(" · "),
      c.near_misses ? el("span", { class: "badge near-miss", text: "near miss" }) : null);
  }

  function renderStep(t, step, i) {
    const head = el("div", { class: "step-head" },
      el("b", { text: `Step ${i + 1}` }),
      el("span", {}, "step reward ", signed(step.reward)),
      step.outcome_reward !== undefined ? el("span", { class: "outcome-reward" }, "outcome reward ", signed(step.outcome_reward)) : null,
      el("span", {}, "advantage ", step.advantage === null ? "–" : signed(step.advantage)),
      el("span", { text: `${step.response_tokens} tokens` }),
      el("span", { text: `stop: ${step.stop_reason}` }),
      toolCounts(step),
      step.terminated ? el("span", { class: "badge", text: "terminated" }) : null,
      step.truncated ? el("span", { class: "badge truncated", text: "truncated" }) : null,
      el("span", { text: `policy v${step.policy_version}` }),
      el("span", { class: `badge ctx-${step.context}`, text: `context: ${step.context}` }));
    return el("div", { class: "step", "data-step": i }, head,
      el("div", { class: "step-body" }, renderPrompt(t, step, i),
        el("div", {}, el("div", { class: "label", text: "Response" }), renderTokens(step)),
        renderTools(step)));
  }

  // "sample 3 of 8": which member of its group a trajectory is (the task id alone repeats per sample).
  function sampleLabel(t) {
    if (t._sample === undefined) {
      const group = groupOf(t);
      t._sample = group.length > 1 ? ` · sample ${group.indexOf(t) + 1} of ${group.length}` : "";
    }
    return t._sample;
  }

  function groupOf(t) {
    return t.group_id ? TRAJ.filter((u) => u.train_step === t.train_step && u.group_id === t.group_id) : [t];
  }

  // the trajectories of one episode of several roles (the seats of one game), in the order they acted
  function episodeOf(t) {
    return t.episode ? TRAJ.filter((u) => u.train_step === t.train_step && u.episode === t.episode) : [t];
  }

  function roleLabel(t) {
    return t.role ? ` · role ${t.role}` : "";
  }

  function renderTrajectory(t) {
    const group = groupOf(t);
    const facts = el("div", { class: "facts" },
      el("span", {}, "outcome ", outcomeBadges(t)),
      el("span", {}, "total reward ", signed(t.total_reward)),
      el("span", {}, "outcome reward ", signed(t.outcome_reward)),
      el("span", { text: `${plural(t.steps.length, "step")} · ${t.num_response_tokens} response tokens` }),
      el("span", { text: `training step ${t.train_step}` }),
      t.group_id ? el("span", { text: `group ${t.group_id} (${group.length} members)` }) : null,
      Object.keys(t.info).length ? el("span", { text: `info ${JSON.stringify(t.info)}` }) : null);
    const episode = episodeOf(t);
    const head = el("div", { class: "traj-head" }, el("h3", { text: `Task ${t.task_id} · trajectory #${t.id}${roleLabel(t)}${sampleLabel(t)}` }),
      el("div", { class: "outcome-line reason", text: t.reason }), facts,
      t.error ? el("pre", { class: "error-text", text: t.error }) : null,
      group.length > 1 ? el("button", { class: "action compare-btn", onclick: () => { state.compare = "group"; renderDetail(); },
        text: `Compare the ${group.length} members of this group side by side` }) : null,
      episode.length > 1 ? el("button", { class: "action episode-btn", onclick: () => { state.compare = "episode"; renderDetail(); },
        text: `Show the ${episode.length} roles of this episode side by side (${episode.map((u) => u.role).join(", ")})` }) : null);
    return el("div", {}, head, t.steps.map((step, i) => renderStep(t, step, i)));
  }

  function renderCompare(t) {
    const byEpisode = state.compare === "episode";
    const group = byEpisode ? episodeOf(t) : groupOf(t);
    const title = byEpisode ? `Episode ${t.episode}: its roles side by side` : `Group ${t.group_id}`;
    const head = el("div", { class: "traj-head" },
      el("h3", { text: `${title} · task ${t.task_id} · training step ${t.train_step}` }),
      el("div", { class: "facts", text: `rewards: ${group.map((u) => fmt(u.total_reward)).join(", ")}` }),
      el("button", { class: "action", onclick: () => { state.compare = false; renderDetail(); }, text: "Back to the trajectory" }));
    const columns = group.map((u) => el("div", { class: "member", "data-id": u.id },
      el("div", { class: "member-head", title: "open this trajectory", onclick: () => select(u.id) },
        el("b", { text: `#${u.id}${roleLabel(u)}` }), " ", outcomeBadges(u),
        el("div", {}, "total reward ", signed(u.total_reward), ` · ${plural(u.steps.length, "step")}`)),
      u.steps.map((step, i) => el("div", { class: "mini-step" },
        el("div", { class: "label" }, `step ${i + 1} · reward `, signed(step.reward),
          step.outcome_reward !== undefined ? [" · outcome ", signed(step.outcome_reward)] : null,
          " · adv ", step.advantage === null ? "–" : signed(step.advantage)),
        renderTokens(step),
        step.tool_calls.map((c) => el("div", { class: "tool-call" }, el("span", { class: "name", text: c.name }),
          `(${JSON.stringify(c.arguments === undefined ? {} : c.arguments)})`)),
        step.tool_errors.map((e) => el("div", { class: "tool-err", text: String(e) }))))));
    return el("div", {}, head, el("div", { class: "compare" }, columns));
  }

  function renderDetail() {
    const box = document.getElementById("detail");
    box.textContent = "";
    const t = BY_ID.get(state.selected);
    if (!t) { box.append(el("div", { class: "placeholder", text: "Select a trajectory on the left to see its steps." })); return; }
    box.append(state.compare ? renderCompare(t) : renderTrajectory(t));
  }

  function renderList() {
    const list = document.getElementById("traj-list");
    list.textContent = "";
    const shown = TRAJ.filter(matches);
    list.append(el("div", { class: "count", text: `${shown.length} of ${TRAJ.length} trajectories` }));
    for (const t of shown) {
      list.append(el("button", { class: `traj-item${t.id === state.selected ? " selected" : ""}`, "data-id": t.id, onclick: () => select(t.id) },
        el("div", { class: "line1" }, el("span", {}, el("b", { text: `#${t.id}` }), ` ${t.task_id}${sampleLabel(t)}`), el("span", {}, outcomeBadges(t))),
        el("div", { class: "line2", text: `step ${t.train_step}${t.group_id ? ` · ${t.group_id}` : ""}${roleLabel(t)} · ${plural(t.steps.length, "step")} · reward ${fmt(t.total_reward)}` }),
        el("div", { class: "reason", text: t.reason })));
    }
  }

  function select(id) {
    state.selected = id;
    state.compare = false;
    renderList();
    renderDetail();
    document.getElementById("detail").scrollIntoView({ block: "nearest" });
  }

  function renderViewer() {
    const root = document.getElementById("viewer");
    if (!TRAJ.length) {
      root.append(el("p", { class: "empty", text: "No trajectories dumped (trajectories/step_*.jsonl)." }));
      return;
    }
    const tags = [...new Set(TRAJ.flatMap((t) => t.tags))].sort();
    const onChange = (key) => (event) => { state[key] = event.target.value; renderList(); };
    const note = DATA.dumped_steps.length > DATA.embedded_steps.length
      ? `embedded training steps ${DATA.embedded_steps.join(", ")} of ${DATA.dumped_steps.length} dumped` : null;
    const toolbar = el("div", { class: "toolbar" },
      el("label", {}, "outcome ", el("select", { id: "filter-outcome", onchange: onChange("outcome") },
        ["all", ...tags].map((tag) => el("option", { value: tag, text: tag })))),
      el("label", {}, "training step ", el("select", { id: "filter-step", onchange: onChange("step") },
        ["all", ...DATA.embedded_steps.map(String)].map((s) => el("option", { value: s, text: s })))),
      el("label", {}, "task ", el("input", { id: "filter-search", type: "search", placeholder: "id, task, group or reason", oninput: onChange("search") })),
      el("label", { title: "tokens whose sampling probability is below this are highlighted" }, "highlight tokens with p < ",
        el("input", { id: "threshold", type: "number", min: "0", max: "1", step: "0.01", value: String(state.threshold),
          onchange: (event) => { const v = parseFloat(event.target.value); if (v > 0 && v <= 1) { state.threshold = v; document.querySelectorAll(".tok[data-lp]").forEach(paintToken); } } })),
      note ? el("span", { class: "empty", text: note }) : null);
    root.append(toolbar, el("div", { class: "viewer" }, el("div", { id: "traj-list", class: "traj-list" }), el("div", { id: "detail", class: "detail" })));
    renderList();
    renderDetail();
  }

  renderCharts();
  renderTimeline();
  renderBreakdown();
  renderViewer();
})();
