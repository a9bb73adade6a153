// memproxy memory manager: a small page over the /v1/memory API (no framework, no build step).
// The admin key lives in sessionStorage (this tab only). Every text from the server is inserted with
// textContent, never as HTML.
"use strict";

const API = "/v1/memory";
const KEY_SLOT = "memproxy.adminKey";
const PAGE = 50;

const state = { key: sessionStorage.getItem(KEY_SLOT) || "", user: null, tab: "fact", cursor: null,
                usersCursor: null };

const $ = (id) => document.getElementById(id);

function el(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(props)) {
    if (name === "class") node.className = value;
    else if (name === "dataset") Object.assign(node.dataset, value);
    else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else if (value !== undefined && value !== null) node.setAttribute(name, value);
  }
  for (const child of children.flat()) {
    if (child !== null && child !== undefined) node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

class ApiError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

async function api(method, path, body) {
  const headers = { Authorization: `Bearer ${state.key}` };
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const res = await fetch(API + path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body) });
  if (res.ok) return res;
  let message = res.statusText;
  try { message = (await res.json()).error.message; } catch (_) { /* not JSON */ }
  if (res.status === 401) lock(message);
  throw new ApiError(res.status, message);
}

const json = async (method, path, body) => (await api(method, path, body)).json();
const userPath = (user) => `/users/${encodeURIComponent(user)}`;

// --- small views -------------------------------------------------------------------------------------

let toastTimer = null;
function toast(message, kind = "info") {
  const box = $("toast");
  box.textContent = message;
  box.className = `toast show ${kind}`;
  clearTimeout(toastTimer);
  toastTimer = setTimeout(() => { box.className = "toast"; }, 4000);
}

function failed(error) { toast(error.message || String(error), "error"); }

const dateFormat = new Intl.DateTimeFormat(undefined, { dateStyle: "medium", timeStyle: "short" });
const dayFormat = new Intl.DateTimeFormat(undefined, { dateStyle: "medium" });

function when(iso) { return iso ? dateFormat.format(new Date(iso)) : "—"; }

function span(start, end) {
  if (!start && !end) return "—";
  const a = start ? dayFormat.format(new Date(start)) : "…";
  const b = end ? dayFormat.format(new Date(end)) : "…";
  return a === b ? a : `${a} – ${b}`;
}

function meta(record) {
  try { return record.meta ? JSON.parse(record.meta) : {}; } catch (_) { return {}; }
}

function source(record) {
  const info = meta(record);
  if (info.source === "api" || info.source === "admin" || info.source === "manual") return "added by hand";
  if (info.explicit) return "asked to remember";
  if (record.source_ids && record.source_ids.length) {
    const turns = record.source_ids.length === 1 ? "1 turn" : `${record.source_ids.length} turns`;
    return `learned from ${turns}`;
  }
  return record.conversation_id ? "conversation" : "—";
}

function importance(value) {
  const level = Math.max(0, Math.min(10, Number(value) || 0));
  const fill = el("span", { class: "fill" });
  fill.style.width = `${level * 10}%`;  // CSSOM, not a style attribute: the page's CSP forbids inline styles
  return el("span", { class: "importance", title: `importance ${level} of 10` },
    el("span", { class: "bar" }, fill), el("span", { class: "num" }, String(level)));
}

function badge(text, kind = "") { return el("span", { class: `badge ${kind}` }, text); }

// --- login -------------------------------------------------------------------------------------------

function lock(message) {
  state.key = "";
  sessionStorage.removeItem(KEY_SLOT);
  $("workspace").hidden = true;
  $("lock").hidden = true;
  $("login").hidden = false;
  $("login-error").textContent = message || "";
  $("key").value = "";
  $("key").focus();
}

async function unlock(key) {
  state.key = key;
  try {
    await loadUsers(true);
  } catch (error) {
    if (error.status !== 401) lock(error.message);
    return;
  }
  sessionStorage.setItem(KEY_SLOT, key);
  $("login").hidden = true;
  $("workspace").hidden = false;
  $("lock").hidden = false;
  const fromHash = new URLSearchParams(location.hash.slice(1)).get("user");
  if (fromHash) openUser(fromHash);
  else if (location.hash === "#dead-letters") showDeadLetters().catch(failed);
}

// --- users -------------------------------------------------------------------------------------------

async function loadUsers(fresh) {
  if (fresh) state.usersCursor = null;
  const query = new URLSearchParams({ limit: "100" });
  if (state.usersCursor) query.set("cursor", state.usersCursor);
  const page = await json("GET", `/users?${query}`);
  const list = $("user-list");
  if (fresh) list.replaceChildren();
  for (const { user_id: user } of page.data) {
    list.append(el("li", {}, el("button", {
      type: "button", class: user === state.user ? "user active" : "user", dataset: { user },
      onclick: () => openUser(user),
    }, user)));
  }
  if (fresh && !page.data.length) list.append(el("li", { class: "muted small" }, "No users yet."));
  state.usersCursor = page.next_cursor;
  $("more-users").hidden = !page.next_cursor;
}

function markActiveUser() {
  for (const button of document.querySelectorAll("#user-list .user")) {
    button.classList.toggle("active", button.dataset.user === state.user);
  }
}

function openUser(user) {
  state.user = user;
  history.replaceState(null, "", `#user=${encodeURIComponent(user)}`);
  $("empty").hidden = true;
  $("dead-view").hidden = true;
  $("user-view").hidden = false;
  $("user-title").textContent = user;
  $("search-result").hidden = true;
  $("search-query").value = "";
  markActiveUser();
  showTab(state.tab);
}

// --- tabs --------------------------------------------------------------------------------------------

function showTab(tab) {
  state.tab = tab;
  for (const button of document.querySelectorAll(".tabs button")) {
    button.classList.toggle("active", button.dataset.tab === tab);
    button.setAttribute("aria-selected", String(button.dataset.tab === tab));
  }
  $("add-form").hidden = tab !== "fact";
  $("history-toggle").hidden = tab !== "fact";
  $("regenerate").hidden = tab !== "insight";
  loadTab(true).catch(failed);
}

async function loadTab(fresh) {
  const body = $("tab-body");
  if (fresh) {
    state.cursor = null;
    body.replaceChildren(el("p", { class: "muted" }, "Loading…"));
  }
  const user = state.user;
  const query = new URLSearchParams({ limit: String(PAGE) });
  if (state.cursor) query.set("cursor", state.cursor);
  let page;
  if (state.tab === "insight") {
    page = await json("GET", `${userPath(user)}/insights?${query}`);
  } else {
    query.set("kind", state.tab);
    if (state.tab === "fact" && $("history").checked) query.set("include_invalid", "true");
    page = await json("GET", `${userPath(user)}/memories?${query}`);
  }
  if (user !== state.user) return;
  renderPage(page.data, fresh);
  state.cursor = page.next_cursor;
  $("more").hidden = !page.next_cursor;
}

const RENDERERS = {
  fact: { head: ["Fact", "Category", "Importance", "Date", "Source", ""], row: factRow },
  summary: { head: ["Summary", "Covers", "Conversation", "Written", ""], row: summaryRow },
  insight: { head: ["Insight", "Confidence", "Covers", "Drawn from", ""], row: insightRow },
  turn: { head: ["Message", "Role", "Conversation", "Date", ""], row: turnRow },
};

const PLURAL = { fact: "facts", summary: "summaries", insight: "insights", turn: "messages" };

function renderPage(records, fresh) {
  const body = $("tab-body");
  const { head, row } = RENDERERS[state.tab];
  let tbody = body.querySelector("tbody");
  if (fresh || !tbody) {
    tbody = el("tbody");
    body.replaceChildren(el("table", { class: "table" },
      el("thead", {}, el("tr", {}, head.map((h) => el("th", {}, h)))), tbody));
  }
  for (const record of records) tbody.append(row(record));
  if (fresh && !records.length) {
    body.replaceChildren(el("p", { class: "empty-tab muted" }, `No ${PLURAL[state.tab]} remembered.`));
  }
}

function actions(record, editable) {
  const cell = el("td", { class: "row-actions" });
  if (editable && record.valid !== false) {
    cell.append(el("button", { type: "button", class: "ghost edit", onclick: () => startEdit(record) }, "Edit"));
  }
  cell.append(el("button", { type: "button", class: "ghost danger-text delete",
                             onclick: () => removeOne(record) }, "Delete"));
  return cell;
}

function textCell(record) {
  const cell = el("td", { class: "text" }, record.text);
  if (record.sensitive) cell.append(" ", badge("sensitive", "warn"));
  if (record.flagged) {
    const flag = badge("flagged: never injected", "warn");
    flag.title = record.flagged;
    cell.append(" ", flag);
  }
  if (record.valid === false) cell.append(" ", badge(record.superseded_by ? "replaced" : "history", "muted"));
  return cell;
}

function factRow(record) {
  return el("tr", { dataset: { id: record.id }, class: record.valid === false ? "invalid" : "" },
    textCell(record),
    el("td", {}, record.category ? badge(record.category) : "—"),
    el("td", {}, importance(record.importance)),
    el("td", { class: "nowrap" }, when(record.created_at)),
    el("td", { class: "small muted nowrap" }, source(record)),
    actions(record, true));
}

function summaryRow(record) {
  return el("tr", { dataset: { id: record.id } }, textCell(record),
    el("td", { class: "nowrap" }, span(record.start_at, record.end_at)),
    el("td", { class: "small muted mono" }, record.conversation_id || "—"),
    el("td", { class: "nowrap" }, when(record.created_at)), actions(record, false));
}

function insightRow(record) {
  const confidence = record.confidence == null ? "—" : `${Math.round(record.confidence * 100)}%`;
  const size = record.size == null ? "—" : `${record.size} memories`;
  return el("tr", { dataset: { id: record.id } }, el("td", { class: "text" }, record.text),
    el("td", {}, confidence), el("td", { class: "nowrap" }, span(record.date_range.start, record.date_range.end)),
    el("td", {}, size), actions(record, false));
}

function turnRow(record) {
  return el("tr", { dataset: { id: record.id } }, textCell(record),
    el("td", {}, record.role ? badge(record.role, record.role === "user" ? "" : "muted") : "—"),
    el("td", { class: "small muted mono" }, record.conversation_id || "—"),
    el("td", { class: "nowrap" }, when(record.created_at)), actions(record, false));
}

// --- edit, delete, forget ----------------------------------------------------------------------------

function startEdit(record) {
  const row = document.querySelector(`tr[data-id="${CSS.escape(record.id)}"]`);
  if (!row) return;
  const text = el("textarea", { class: "edit-text", rows: "3" });
  text.value = record.text;
  const level = el("input", { type: "number", min: "1", max: "10", class: "edit-importance",
                              "aria-label": "Importance" });
  level.value = String(record.importance);
  const save = el("button", { type: "button", class: "primary save" }, "Save");
  const cancel = el("button", { type: "button", class: "ghost" }, "Cancel");
  const editor = el("tr", { class: "editing", dataset: { id: record.id } },
    el("td", { colspan: String(row.children.length) },
      el("div", { class: "editor" }, text,
        el("div", { class: "editor-actions" }, el("label", {}, "Importance ", level), cancel, save))));
  row.replaceWith(editor);
  text.focus();
  cancel.addEventListener("click", () => editor.replaceWith(row));
  save.addEventListener("click", async () => {
    const change = {};
    if (text.value.trim() !== record.text) change.text = text.value;
    if (Number(level.value) !== record.importance) change.importance = Number(level.value);
    if (!Object.keys(change).length) { editor.replaceWith(row); return; }
    try {
      await json("PATCH", `${userPath(state.user)}/memories/${encodeURIComponent(record.id)}`, change);
      toast(change.text ? "Saved. The old wording is kept in history." : "Saved.");
      await loadTab(true);
    } catch (error) { failed(error); }
  });
}

function confirmDialog({ title, text, ok, typed }) {
  const dialog = $("confirm");
  $("confirm-title").textContent = title;
  $("confirm-text").textContent = text;
  $("confirm-ok").textContent = ok;
  $("confirm-typed").hidden = !typed;
  const input = $("confirm-input");
  input.value = "";
  $("confirm-ok").disabled = Boolean(typed);
  input.oninput = () => { $("confirm-ok").disabled = input.value !== typed; };
  return new Promise((resolve) => {
    dialog.addEventListener("close", () => resolve(dialog.returnValue === "ok"), { once: true });
    dialog.returnValue = "";
    dialog.showModal();
    (typed ? input : $("confirm-cancel")).focus();
  });
}

async function removeOne(record) {
  const ok = await confirmDialog({ title: "Delete this memory?", text: `“${record.text}”`, ok: "Delete" });
  if (!ok) return;
  try {
    await json("DELETE", `${userPath(state.user)}/memories/${encodeURIComponent(record.id)}`);
    document.querySelector(`tr[data-id="${CSS.escape(record.id)}"]`)?.remove();
    if (!document.querySelector("#tab-body tbody tr")) await loadTab(true);
    toast("Deleted.");
  } catch (error) { failed(error); }
}

async function forgetUser() {
  const user = state.user;
  const ok = await confirmDialog({
    title: "Forget everything about this user?",
    text: `Every fact, summary, insight and message kept about ${user} is erased from disk. This cannot be undone.`,
    ok: "Forget everything", typed: user,
  });
  if (!ok) return;
  try {
    const result = await json("DELETE", userPath(user));
    toast(`Forgot ${user}: ${result.total} records erased.`);
    await loadUsers(true);
    openUser(user);
  } catch (error) { failed(error); }
}

async function exportUser() {
  try {
    const res = await api("GET", `${userPath(state.user)}/export`);
    const url = URL.createObjectURL(await res.blob());
    const name = `memories-${state.user.replace(/[^A-Za-z0-9._-]/g, "_")}.jsonl`;
    const link = el("a", { href: url, download: name });
    document.body.append(link);
    link.click();
    link.remove();
    setTimeout(() => URL.revokeObjectURL(url), 1000);
  } catch (error) { failed(error); }
}

async function addFact(event) {
  event.preventDefault();
  const text = $("add-text").value.trim();
  if (!text) return;
  try {
    await json("POST", `${userPath(state.user)}/memories`,
      { text, kind: "fact", importance: Number($("add-importance").value) || 5 });
    $("add-text").value = "";
    toast("Fact added.");
    await Promise.all([loadTab(true), loadUsers(true)]);
  } catch (error) { failed(error); }
}

async function regenerate() {
  try {
    await json("POST", `${userPath(state.user)}/insights/regenerate`);
    toast("Insight run queued; refresh in a moment.");
  } catch (error) { failed(error); }
}

// --- search preview ----------------------------------------------------------------------------------

async function preview(event) {
  event.preventDefault();
  const query = $("search-query").value.trim();
  if (!query) return;
  try {
    const result = await json("POST", `${userPath(state.user)}/search`, { query, k: 10 });
    $("search-arms").replaceChildren(...result.arms.map((arm) =>
      badge(arm, arm.startsWith("degraded") ? "warn" : arm === "gated" ? "muted" : "")));
    $("search-rows").replaceChildren(...result.results.map((hit) => el("tr", {},
      el("td", { class: "text" }, hit.text, ...(hit.flagged ? [" ", badge("flagged: never injected", "warn")] : [])),
      el("td", {}, badge(hit.kind, "muted")),
      el("td", { class: "mono" }, Number(hit.score).toFixed(3)),
      el("td", { class: "small muted mono" },
        Object.entries(hit.arms || {}).map(([arm, score]) => `${arm} ${Number(score).toFixed(2)}`).join(" · ")))));
    if (!result.results.length) {
      $("search-rows").append(el("tr", {}, el("td", { colspan: "4", class: "muted" }, "Nothing relevant found.")));
    }
    $("search-block").textContent = result.injected_block || "(nothing would be injected)";
    $("search-result").hidden = false;
  } catch (error) { failed(error); }
}

// --- dead letters ------------------------------------------------------------------------------------

function deadRow(job) {
  return el("tr", { dataset: { job: job.id } },
    el("td", {}, badge(job.kind)),
    el("td", {}, job.user_id),
    el("td", { class: "num" }, String(job.attempts)),
    el("td", { class: "nowrap" }, when(job.updated_at)),
    el("td", { class: "error-text" }, job.last_error || "—"),
    el("td", {}, el("button", { type: "button", class: "requeue", onclick: () => requeue(job) }, "Requeue")));
}

async function showDeadLetters() {
  state.user = null;
  markActiveUser();
  history.replaceState(null, "", "#dead-letters");
  $("empty").hidden = true;
  $("user-view").hidden = true;
  $("dead-view").hidden = false;
  const page = await json("GET", "/dead-letters?limit=200");
  const rows = $("dead-rows");
  rows.replaceChildren(...page.data.map(deadRow));
  if (!page.data.length) {
    rows.append(el("tr", {}, el("td", { colspan: "6", class: "muted" }, "No dead letters: every memory job finished.")));
  }
}

async function requeue(job) {
  try {
    await json("POST", `/dead-letters/${encodeURIComponent(job.id)}/requeue`);
    toast(`Requeued the ${job.kind} job.`);
    await showDeadLetters();
  } catch (error) { failed(error); }
}

// --- wiring ------------------------------------------------------------------------------------------

function wire() {
  $("login-form").addEventListener("submit", (event) => {
    event.preventDefault();
    unlock($("key").value.trim());
  });
  $("lock").addEventListener("click", () => lock(""));
  $("open-user").addEventListener("submit", (event) => {
    event.preventDefault();
    const user = $("user-input").value.trim();
    if (user) openUser(user);
  });
  $("more-users").addEventListener("click", () => loadUsers(false).catch(failed));
  for (const button of document.querySelectorAll(".tabs button")) {
    button.addEventListener("click", () => showTab(button.dataset.tab));
  }
  $("history").addEventListener("change", () => loadTab(true).catch(failed));
  $("more").addEventListener("click", () => loadTab(false).catch(failed));
  $("add-form").addEventListener("submit", addFact);
  $("forget").addEventListener("click", forgetUser);
  $("export").addEventListener("click", exportUser);
  $("regenerate").addEventListener("click", regenerate);
  $("search-form").addEventListener("submit", preview);
  $("open-dead").addEventListener("click", () => showDeadLetters().catch(failed));
  $("dead-refresh").addEventListener("click", () => showDeadLetters().catch(failed));
}

wire();
if (state.key) unlock(state.key); else lock("");
