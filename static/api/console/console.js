// The console (docs/console.md): signs in with an API key and calls the JSON API with it.
// The key lives in this closure only: never in storage, a cookie, the URL or a log. Every value
// from the server is shown as text (textContent, text nodes): no HTML is ever parsed from it.
"use strict";

(() => {
  let apiKey = null;
  let auditCursor = null;
  let channelsCursor = null;

  const $ = (id) => document.getElementById(id);
  const SVG = "http://www.w3.org/2000/svg";

  /** An element with `className` (optional) and children (strings become text nodes). */
  function el(tag, className, ...children) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    for (const child of children) {
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  function svg(tag, attributes) {
    const node = document.createElementNS(SVG, tag);
    for (const [name, value] of Object.entries(attributes)) node.setAttribute(name, String(value));
    return node;
  }

  function when(timestamp) {
    if (!timestamp) return "never";
    const date = new Date(timestamp);
    return isNaN(date) ? String(timestamp) : date.toISOString().replace("T", " ").slice(0, 19) + " UTC";
  }

  class ApiError extends Error {
    constructor(status, text) {
      super(text);
      this.status = status;
    }
  }

  /** One call of the JSON API with the key: the parsed body (null for 204), or ApiError. */
  async function call(method, path, body) {
    const headers = { Authorization: "Bearer " + apiKey };
    const init = { method, headers, cache: "no-store", credentials: "omit", redirect: "error" };
    if (body !== undefined) {
      headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(body);
    }
    let response;
    try {
      response = await fetch(path, init);
    } catch (_) {
      throw new ApiError(0, "the server cannot be reached");
    }
    let data = null;
    if (response.status !== 204) {
      try {
        data = await response.json();
      } catch (_) {
        data = null;
      }
    }
    if (!response.ok) {
      const text = data && typeof data.error === "string" ? data.error : "HTTP " + response.status;
      throw new ApiError(response.status, text);
    }
    return data;
  }

  /** Runs `action`, showing its failure in the status line; a 401 signs out. */
  async function guarded(action) {
    $("status").textContent = "";
    try {
      await action();
    } catch (error) {
      if (error instanceof ApiError && error.status === 401 && apiKey !== null) {
        signOut("Signed out: " + error.message);
        return;
      }
      $("status").textContent = error instanceof ApiError ? error.message : "unexpected error";
    }
  }

  // -- sign in and out ------------------------------------------------------------------------

  function clearData() {
    for (const id of ["account", "channels"]) $(id).replaceChildren();
    for (const id of ["keys", "audit"]) $(id).tBodies[0].replaceChildren();
    $("rate-chart").replaceChildren();
    $("rate-total").textContent = "";
    hideSecret();
    $("status").textContent = "";
  }

  function signOut(message) {
    apiKey = null;
    clearData();
    $("app").hidden = true;
    $("sign-out").hidden = true;
    $("sign-in").hidden = false;
    $("sign-in-error").textContent = message || "";
    $("api-key").focus();
  }

  async function signIn(event) {
    event.preventDefault();
    const input = $("api-key");
    const key = input.value.trim();
    input.value = "";
    $("sign-in-error").textContent = "";
    if (!key) return;
    apiKey = key;
    let account;
    try {
      account = await call("GET", "/v1/accounts/me");
    } catch (error) {
      apiKey = null;
      $("sign-in-error").textContent = error instanceof ApiError ? error.message : "unexpected error";
      return;
    }
    $("sign-in").hidden = true;
    $("app").hidden = false;
    $("sign-out").hidden = false;
    renderAccount(account, key.slice(0, 16));
    show("account");
  }

  // -- views ----------------------------------------------------------------------------------

  const loaders = {
    account: async () => renderAccount(await call("GET", "/v1/accounts/me"), apiKey.slice(0, 16)),
    keys: loadKeys,
    channels: () => loadChannels(false),
    audit: () => loadAudit(false),
    activity: loadRate,
  };

  function show(view) {
    for (const button of document.querySelectorAll("nav button")) {
      button.classList.toggle("active", button.dataset.view === view);
    }
    for (const section of document.querySelectorAll(".view")) {
      section.hidden = section.id !== "view-" + view;
    }
    return guarded(loaders[view]);
  }

  function renderAccount(account, prefix) {
    const rows = [
      ["Account id", account.id, true],
      ["Email", account.email],
      ["Name", account.name || "(none)"],
      ["Plan", account.plan_tier],
      ["Signed in with", prefix + "\u2026", true],
    ];
    $("account").replaceChildren(
      ...rows.flatMap(([term, value, mono]) => [el("dt", "", term), el("dd", mono ? "mono" : "", value)])
    );
  }

  // Keys: create (shown once), roll and revoke (each confirmed first), last used.

  function showSecret(title, secret) {
    $("secret-title").textContent = title;
    $("secret-value").value = secret;
    $("secret-copied").textContent = "";
    $("secret").hidden = false;
    $("secret-value").select();
  }

  function hideSecret() {
    $("secret-value").value = "";
    $("secret-title").textContent = "";
    $("secret-copied").textContent = "";
    $("secret").hidden = true;
  }

  async function copySecret() {
    const field = $("secret-value");
    field.select();
    try {
      await navigator.clipboard.writeText(field.value);
      $("secret-copied").textContent = "Copied.";
    } catch (_) {
      // No clipboard permission: the text is selected, ready for Ctrl+C.
      $("secret-copied").textContent = "Selected: press Ctrl+C to copy.";
    }
  }

  async function createKey(event) {
    event.preventDefault();
    await guarded(async () => {
      const name = $("new-key-name").value.trim();
      const created = await call("POST", "/v1/keys", name ? { name } : {});
      $("new-key-name").value = "";
      showSecret("New key \u201c" + created.name + "\u201d (" + created.key_prefix + ")", created.key);
      await loadKeys();
    });
  }

  /** Replaces the actions of `cell` with a question and Confirm / Cancel. */
  function confirmIn(cell, question, label, action) {
    const restore = Array.from(cell.childNodes);
    const yes = el("button", "danger", label);
    const no = el("button", "", "Cancel");
    yes.type = no.type = "button";
    yes.addEventListener("click", () => guarded(action));
    no.addEventListener("click", () => cell.replaceChildren(...restore));
    cell.replaceChildren(el("span", "confirm", question), yes, no);
  }

  async function loadKeys() {
    const { keys } = await call("GET", "/v1/keys");
    const rows = keys.map((key) => {
      const actions = el("td", "actions");
      const roll = el("button", "", "Roll");
      const revoke = el("button", "danger", "Revoke");
      roll.type = revoke.type = "button";
      roll.addEventListener("click", () =>
        confirmIn(actions, "Roll \u201c" + key.name + "\u201d? The old key keeps working for an hour.",
          "Roll", async () => {
            const rolled = await call("POST", "/v1/keys/" + encodeURIComponent(key.id) + "/roll", {});
            showSecret("Rolled key \u201c" + rolled.name + "\u201d (" + rolled.key_prefix + ")", rolled.key);
            await loadKeys();
          })
      );
      revoke.addEventListener("click", () =>
        confirmIn(actions, "Revoke \u201c" + key.name + "\u201d? It stops working at once.",
          "Revoke", async () => {
            await call("DELETE", "/v1/keys/" + encodeURIComponent(key.id));
            await loadKeys();
          })
      );
      actions.append(roll, " ", revoke);
      const row = el(
        "tr", "",
        el("td", "", key.name),
        el("td", "mono", key.key_prefix),
        el("td", "", key.scopes.join(", ")),
        el("td", "mono", key.channels === null ? "all" : key.channels.join(", ")),
        el("td", "", when(key.created_at)),
        el("td", "", when(key.last_used_at)),
        el("td", "", key.expires_at ? when(key.expires_at) : "never"),
        actions
      );
      row.dataset.keyId = key.id;
      return row;
    });
    $("keys").tBodies[0].replaceChildren(...rows);
  }

  // Channels: each with its roster, epoch, last activity and retention policy.

  function retention(policy) {
    const parts = [];
    if (policy.max_age_seconds !== null) parts.push("max age " + policy.max_age_seconds + " s");
    if (policy.max_entries !== null) parts.push("max " + policy.max_entries + " entries");
    if (policy.max_bytes !== null) parts.push("max " + policy.max_bytes + " bytes");
    return parts.length ? parts.join(", ") : "server default";
  }

  function renderChannel(channel) {
    const roster = el("table", "roster",
      el("thead", "", el("tr", "", el("th", "", "Leaf"), el("th", "", "Identity"),
        el("th", "", "Account"), el("th", "", "Bound"))));
    const body = el("tbody", "");
    for (const member of channel.members) {
      body.append(el("tr", "",
        el("td", "", member.leaf_index),
        el("td", "mono", member.identity),
        el("td", "mono", member.account === null ? "\u2014" : member.account),
        el("td", "", member.bound ? "bound" : "not bound")));
    }
    roster.append(body);
    const more = channel.member_count > channel.members.length
      ? " (" + channel.members.length + " of " + channel.member_count + " shown)" : "";
    return el("div", "channel",
      el("h3", "", channel.name),
      el("p", "meta",
        "epoch " + channel.epoch + " \u00b7 " + channel.messages + " messages \u00b7 last activity "
        + when(channel.last_activity_at) + " \u00b7 retention: " + retention(channel.retention)
        + " \u00b7 " + channel.member_count + " members" + more),
      roster);
  }

  async function loadChannels(more) {
    const query = more && channelsCursor ? "?cursor=" + encodeURIComponent(channelsCursor) : "";
    const page = await call("GET", "/v1/channels" + query);
    const nodes = page.channels.map(renderChannel);
    if (more) $("channels").append(...nodes);
    else $("channels").replaceChildren(...nodes);
    if (!more && nodes.length === 0 && page.next_cursor === null) {
      $("channels").append(el("p", "hint", "No channels yet."));
    }
    channelsCursor = page.next_cursor;
    $("channels-more").hidden = channelsCursor === null;
  }

  // The audit log, newest first, paged by next_cursor.

  async function loadAudit(more) {
    const query = "?limit=25" + (more && auditCursor ? "&cursor=" + encodeURIComponent(auditCursor) : "");
    const page = await call("GET", "/v1/audit" + query);
    const rows = page.events.map((event) => {
      const { id, at, type, key_id, channel, ...rest } = event;
      return el("tr", "",
        el("td", "", when(at)),
        el("td", "mono", type),
        el("td", "mono", key_id === null ? "server" : key_id),
        el("td", "mono", channel || ""),
        el("td", "mono", Object.keys(rest).length ? JSON.stringify(rest) : ""));
    });
    if (more) $("audit").tBodies[0].append(...rows);
    else $("audit").tBodies[0].replaceChildren(...rows);
    auditCursor = page.next_cursor;
    $("audit-more").hidden = auditCursor === null;
  }

  // The account's message rate: one bar a minute over the last hour, an SVG built here.

  async function loadRate() {
    const rate = await call("GET", "/v1/channels/rate");
    const counts = rate.per_minute;
    const width = 720, height = 180, top = 10, bottom = 24, left = 36;
    const peak = Math.max(1, ...counts);
    const step = (width - left - 4) / counts.length;
    const chart = svg("svg", { width, height, viewBox: `0 0 ${width} ${height}`, role: "img" });
    chart.append(svg("title", {}));
    chart.firstChild.textContent = "Messages per minute, last hour";
    chart.append(svg("line", { x1: left, y1: height - bottom, x2: width, y2: height - bottom }));
    const label = (x, y, text, anchor) => {
      const node = svg("text", { x, y, "text-anchor": anchor });
      node.textContent = text;
      chart.append(node);
    };
    label(left - 6, top + 8, String(peak), "end");
    label(left - 6, height - bottom, "0", "end");
    counts.forEach((count, i) => {
      const barHeight = ((height - top - bottom) * count) / peak;
      const bar = svg("rect", {
        x: (left + i * step + 1).toFixed(1),
        y: (height - bottom - barHeight).toFixed(1),
        width: Math.max(1, step - 2).toFixed(1),
        height: barHeight.toFixed(1),
      });
      bar.dataset.count = String(count);
      const tip = svg("title", {});
      tip.textContent = count + " messages";
      bar.append(tip);
      chart.append(bar);
    });
    label(left, height - 6, "60 min ago", "start");
    label(width - 4, height - 6, "now", "end");
    $("rate-chart").replaceChildren(chart);
    $("rate-total").textContent = rate.total + " messages sent by this account in the last hour.";
  }

  // -- wiring ---------------------------------------------------------------------------------

  document.addEventListener("DOMContentLoaded", () => {
    $("sign-in-form").addEventListener("submit", signIn);
    $("sign-out").addEventListener("click", () => signOut(""));
    $("create-key-form").addEventListener("submit", createKey);
    $("secret-copy").addEventListener("click", copySecret);
    $("secret-done").addEventListener("click", hideSecret);
    $("channels-more").addEventListener("click", () => guarded(() => loadChannels(true)));
    $("audit-more").addEventListener("click", () => guarded(() => loadAudit(true)));
    $("rate-refresh").addEventListener("click", () => guarded(loadRate));
    for (const button of document.querySelectorAll("nav button")) {
      button.addEventListener("click", () => show(button.dataset.view));
    }
    $("api-key").focus();
  });
})();
